"""Scheduler: token budget, chunked prefill, FCFS admission, preemption, finishing, and a seeded
random simulation that checks block ownership and cached KV contents after every step."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from nostall.config import SchedulerConfig
from nostall.errors import ConfigError, InvalidRequestError
from nostall.kv.kv_cache_manager import KVCacheManager
from nostall.sampling_params import SamplingParams
from nostall.scheduler.output import SchedulerOutput
from nostall.scheduler.request import Request, RequestStatus
from nostall.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4


def _scheduler(
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    chunked: bool = True,
    caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=caching))


def _request(request_id: str, num_tokens: int, first_token: int = 0) -> Request:
    return Request(request_id, list(range(first_token, first_token + num_tokens)), SamplingParams())


def _plan(out: SchedulerOutput) -> dict[str, int]:
    """Scheduled request id -> number of new tokens, in output order."""
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def _sample(out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after a step: a request whose tokens are all computed gets one more."""
    for s in out.scheduled:
        if s.request.num_computed_tokens == s.request.num_tokens:
            s.request.append_output_token_ids(token)


def _step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    _sample(out)
    return out


def test_chunked_prefill_splits_a_long_prompt_and_mixes_with_decodes() -> None:
    scheduler = _scheduler(max_num_batched_tokens=16)
    a, b = _request("a", 10), _request("b", 30, first_token=100)
    scheduler.add_request(a)
    assert _plan(_step(scheduler)) == {"a": 10}
    scheduler.add_request(b)

    out = _step(scheduler)
    assert _plan(out) == {"a": 1, "b": 15}
    assert out.total_num_scheduled_tokens == 16
    assert [s.is_new for s in out.scheduled] == [False, True]
    assert [s.num_computed_before for s in out.scheduled] == [10, 0]
    assert b.num_computed_tokens == 15 and b.num_output_tokens == 0

    out = _step(scheduler)
    assert _plan(out) == {"a": 1, "b": 15}
    assert out.scheduled[1].num_computed_before == 15 and not out.scheduled[1].is_new
    assert b.num_output_tokens == 1

    out = _step(scheduler)
    assert _plan(out) == {"a": 1, "b": 1}
    assert out.total_num_scheduled_tokens == 2


def test_block_ids_cover_the_scheduled_tokens() -> None:
    scheduler = _scheduler(max_num_batched_tokens=6)
    scheduler.add_request(_request("a", 10))
    first = _step(scheduler).scheduled[0]
    assert first.block_ids == first.new_block_ids == [1, 2]
    second = _step(scheduler).scheduled[0]
    assert (second.num_computed_before, second.num_new_tokens) == (6, 4)
    # The runner already holds [1, 2]: only the new block travels.
    assert second.block_ids == [] and second.new_block_ids == [3]
    assert scheduler.kv_cache_manager.get_block_ids("a") == [1, 2, 3]


def test_max_num_seqs_is_respected() -> None:
    scheduler = _scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(_request(name, 4))
    assert _plan(_step(scheduler)) == {"a": 4, "b": 4}
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    assert _plan(_step(scheduler)) == {"a": 1, "b": 1}
    scheduler.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert _plan(_step(scheduler)) == {"b": 1, "c": 4}


def test_admission_is_fcfs_and_a_blocked_head_blocks_the_queue() -> None:
    scheduler = _scheduler(max_num_batched_tokens=8, max_model_len=8, chunked=False)
    for name, n, first_token in (("a", 6, 0), ("b", 6, 100), ("c", 1, 200)):
        scheduler.add_request(_request(name, n, first_token))
    # b does not fit in the 2 tokens left; c would, but does not overtake b.
    assert _plan(_step(scheduler)) == {"a": 6}
    out = _step(scheduler)
    assert _plan(out) == {"a": 1, "b": 6, "c": 1}
    assert [s.is_new for s in out.scheduled] == [False, True, True]


def test_without_chunking_a_prompt_that_does_not_fit_waits_whole() -> None:
    scheduler = _scheduler(max_num_batched_tokens=16, max_model_len=16, chunked=False)
    scheduler.add_request(_request("a", 4))
    _step(scheduler)
    scheduler.add_request(_request("b", 16, first_token=50))
    assert _plan(_step(scheduler)) == {"a": 1}
    assert scheduler.num_waiting == 1
    scheduler.finish_requests("a", RequestStatus.FINISHED_LENGTH)
    assert _plan(_step(scheduler)) == {"b": 16}


def test_with_chunking_the_same_prompt_is_split() -> None:
    scheduler = _scheduler(max_num_batched_tokens=16, max_model_len=16)
    scheduler.add_request(_request("a", 4))
    _step(scheduler)
    scheduler.add_request(_request("b", 16, first_token=50))
    assert _plan(_step(scheduler)) == {"a": 1, "b": 15}
    assert _plan(_step(scheduler)) == {"a": 1, "b": 1}


def test_prefix_hits_share_blocks_and_set_num_cached_tokens() -> None:
    scheduler = _scheduler()
    a = _request("a", 10)
    b = Request("b", [*range(8), 90, 91], SamplingParams())
    scheduler.add_request(a)
    scheduler.add_request(b)
    # Both in one step: b hits the blocks a registers in this very step.
    out = _step(scheduler)
    assert _plan(out) == {"a": 10, "b": 2}
    sa, sb = out.scheduled
    assert sb.num_computed_before == 8
    assert sb.block_ids[:2] == sa.block_ids[:2] and sb.block_ids[2] != sa.block_ids[2]
    assert sb.new_block_ids == sb.block_ids
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    assert scheduler.kv_cache_manager.get_block_ids("b") == sb.block_ids
    assert scheduler.kv_cache_manager.prefix_cache_hits == 8


def test_preemption_takes_the_newest_and_it_recomputes_from_zero() -> None:
    # 4 usable blocks of 4 tokens.
    scheduler = _scheduler(num_blocks=5, max_model_len=16, caching=False)
    a, b = _request("a", 6), _request("b", 6, first_token=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert _plan(_step(scheduler)) == {"a": 6, "b": 6}
    assert _plan(_step(scheduler)) == {"a": 1, "b": 1}
    assert _plan(_step(scheduler)) == {"a": 1, "b": 1}
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    # a's 9th token needs a third block: b, the newest, is preempted; nothing is admitted.
    out = _step(scheduler)
    assert _plan(out) == {"a": 1}
    assert out.preempted_request_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)

    # b needs 3 blocks to resume; only 1 is free until a finishes.
    assert _plan(_step(scheduler)) == {"a": 1}
    scheduler.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    out = _step(scheduler)
    (resumed,) = out.scheduled
    assert resumed.request is b and resumed.is_new
    assert (resumed.num_computed_before, resumed.num_new_tokens) == (0, 9)
    assert b.status == RequestStatus.RUNNING and b.num_output_tokens == 4
    scheduler.finish_requests("b", RequestStatus.FINISHED_STOPPED)
    assert scheduler.kv_cache_manager.num_free_blocks == 4
    assert not scheduler.has_unfinished_requests()


def test_a_preempted_request_resumes_from_its_surviving_cached_blocks() -> None:
    scheduler = _scheduler(num_blocks=5, max_model_len=16)
    a, b = _request("a", 6), _request("b", 6, first_token=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(4):
        out = _step(scheduler)
    assert out.preempted_request_ids == ["b"]
    # a took b's tail block; b's first block is still cached.
    scheduler.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    (resumed,) = _step(scheduler).scheduled
    assert resumed.request is b and resumed.is_new
    assert (resumed.num_computed_before, resumed.num_new_tokens) == (4, 5)
    assert b.num_cached_tokens == 0


def test_the_newest_request_preempts_itself_and_is_not_readmitted_in_that_step() -> None:
    # 5 usable blocks, 8 tokens per step.
    scheduler = _scheduler(num_blocks=6, max_num_batched_tokens=8, max_model_len=20, caching=False)
    a, b = _request("a", 8), _request("b", 8, first_token=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert _plan(_step(scheduler)) == {"a": 8}
    assert _plan(_step(scheduler)) == {"a": 1, "b": 7}
    assert _plan(_step(scheduler)) == {"a": 1, "b": 1}
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    # b (last in running) needs a block and none is free: it is its own victim. A 7-token chunk
    # of b would fit in the 2 blocks it freed, but nothing is admitted in a step that preempted.
    out = _step(scheduler)
    assert _plan(out) == {"a": 1}
    assert out.preempted_request_ids == ["b"]
    assert scheduler.kv_cache_manager.num_free_blocks == 2

    out = _step(scheduler)
    assert _plan(out) == {"a": 1, "b": 7}
    assert out.scheduled[1].is_new and out.scheduled[1].num_computed_before == 0


def test_finish_waiting_running_and_unknown_requests() -> None:
    scheduler = _scheduler(max_num_seqs=1)
    running, waiting = _request("running", 9), _request("waiting", 5)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    _step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 60
    scheduler.finish_requests(["waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("running", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("running", RequestStatus.FINISHED_STOPPED)
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache_manager.num_free_blocks == 63
    assert not scheduler.has_unfinished_requests() and scheduler.has_finished_requests()
    assert scheduler.get_request("running") is None

    out = scheduler.schedule()
    assert out.is_empty and out.total_num_scheduled_tokens == 0
    assert out.finished_request_ids == ["waiting", "running"]
    assert scheduler.schedule().finished_request_ids == []
    assert not scheduler.has_finished_requests()


def test_finish_a_preempted_request() -> None:
    scheduler = _scheduler(num_blocks=5, max_model_len=16)
    scheduler.add_request(_request("a", 6))
    scheduler.add_request(_request("b", 6, first_token=100))
    for _ in range(4):
        out = _step(scheduler)
    assert out.preempted_request_ids == ["b"]
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_waiting == 0
    assert scheduler.schedule().finished_request_ids == ["b"]


def test_finish_requests_needs_a_finished_status() -> None:
    scheduler = _scheduler()
    with pytest.raises(ValueError, match="status=RUNNING"):
        scheduler.finish_requests("a", RequestStatus.RUNNING)


def test_add_request_rejects_bad_requests() -> None:
    scheduler = _scheduler(max_model_len=16)
    with pytest.raises(InvalidRequestError, match="has 0 tokens"):
        scheduler.add_request(_request("empty", 0))
    with pytest.raises(InvalidRequestError, match="has 17 tokens"):
        scheduler.add_request(_request("long", 17))
    scheduler.add_request(_request("a", 3))
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add_request(_request("a", 3))
    assert scheduler.get_request("a") is not None and scheduler.num_waiting == 1


def test_a_cache_smaller_than_max_model_len_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_model_len=64 does not fit"):
        _scheduler(num_blocks=16, max_model_len=64)


class _Simulation:
    """Drives a scheduler like an engine and checks every invariant after every step.

    The fake KV cache maps (block id, offset) to the token whose KV would sit there. After each
    step's writes, every scheduled request must read exactly its own tokens through its block
    table: this is what makes prefix hits and eviction correct, not merely consistent.
    """

    def __init__(self, seed: int, caching: bool, chunked: bool) -> None:
        self.rng = random.Random(seed)
        self.max_model_len = 48
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=6,
                max_num_batched_tokens=24 if chunked else 48,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=chunked,
            ),
            KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, enable_caching=caching),
        )
        self.manager = self.scheduler.kv_cache_manager
        self.chunked = chunked
        self.kv: dict[tuple[int, int], int] = {}
        # The block tables a runner holds, rebuilt from the deltas the scheduler reports.
        self.runner_tables: dict[str, list[int]] = {}
        self.reported_finished: Counter[str] = Counter()
        self.finished: set[str] = set()
        self.max_output: dict[str, int] = {}
        self.live: dict[str, Request] = {}
        self.all_requests: list[Request] = []
        self.arrivals = self._arrivals(num_requests=60, last_step=120)

    def _arrivals(self, num_requests: int, last_step: int) -> list[tuple[int, Request]]:
        rng = self.rng
        prefixes = [[rng.randrange(1000) for _ in range(n)] for n in (5, 12, 20)]
        arrivals = []
        for i in range(num_requests):
            prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompt = [*prefix, *(rng.randrange(1000) for _ in range(rng.randrange(1, 20)))]
            request = Request(f"r{i}", prompt, SamplingParams())
            self.max_output[request.request_id] = rng.randint(1, self.max_model_len - len(prompt))
            arrivals.append((rng.randrange(last_step), request))
        arrivals.sort(key=lambda a: a[0])
        return arrivals

    def run(self, max_steps: int = 3000) -> None:
        for step in range(max_steps):
            while self.arrivals and self.arrivals[0][0] <= step:
                request = self.arrivals.pop(0)[1]
                self.scheduler.add_request(request)
                self.live[request.request_id] = request
                self.all_requests.append(request)
            if self.rng.random() < 0.05:
                ids = [r.request_id for r in self.all_requests] + ["unknown"]
                self._finish(self.rng.choice(ids), RequestStatus.FINISHED_ABORTED)
            out = self.scheduler.schedule()
            self._check_output(out)
            self._execute(out)
            for s in out.scheduled:
                request = s.request
                if request.num_computed_tokens == request.num_tokens:
                    request.append_output_token_ids(self.rng.randrange(1000))
                    if request.num_output_tokens >= self.max_output[request.request_id]:
                        self._finish(request.request_id, RequestStatus.FINISHED_STOPPED)
            self._check_state()
            if not self.arrivals and not self.scheduler.has_unfinished_requests():
                break
        else:
            pytest.fail(f"requests still unfinished after {max_steps} steps")
        self._check_output(self.scheduler.schedule())

    def _finish(self, request_id: str, status: RequestStatus) -> None:
        if self.live.pop(request_id, None) is not None:
            self.finished.add(request_id)
        self.scheduler.finish_requests(request_id, status)

    def _check_output(self, out: SchedulerOutput) -> None:
        config = self.scheduler.config
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)) <= config.max_num_seqs
        assert self.scheduler.num_running <= config.max_num_seqs
        assert sum(s.num_new_tokens for s in out.scheduled) == out.total_num_scheduled_tokens
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert not set(ids) & set(out.preempted_request_ids)
        self.reported_finished.update(out.finished_request_ids)
        for gone in (*out.preempted_request_ids, *out.finished_request_ids):
            self.runner_tables.pop(gone, None)
        is_new = [s.is_new for s in out.scheduled]
        assert is_new == sorted(is_new), "running requests come before newly admitted ones"
        for s in out.scheduled:
            request = s.request
            end = s.num_computed_before + s.num_new_tokens
            assert (
                s.num_new_tokens >= 1 and end == request.num_computed_tokens <= request.num_tokens
            )
            rid = request.request_id
            assert s.is_new == (rid not in self.runner_tables)
            if s.is_new:
                assert s.block_ids[len(s.block_ids) - len(s.new_block_ids) :] == s.new_block_ids
                self.runner_tables[rid] = list(s.block_ids)
            else:
                assert s.block_ids == []
                self.runner_tables[rid].extend(s.new_block_ids)
            table = self.runner_tables[rid]
            assert table == self.manager.get_block_ids(rid)
            assert len(table) * BLOCK_SIZE >= end and 0 not in table
            if s.is_new and not self.chunked:
                assert end == request.num_tokens

    def _execute(self, out: SchedulerOutput) -> None:
        """Write every new token's KV first, then check what every request reads."""
        for s in out.scheduled:
            table = self.runner_tables[s.request.request_id]
            for pos in range(s.num_computed_before, s.num_computed_before + s.num_new_tokens):
                slot = (table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
                self.kv[slot] = s.request.all_token_ids[pos]
        for s in out.scheduled:
            table = self.runner_tables[s.request.request_id]
            for pos in range(s.num_computed_before + s.num_new_tokens):
                slot = (table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
                assert self.kv[slot] == s.request.all_token_ids[pos]

    def _check_state(self) -> None:
        pool = self.manager.block_pool
        owners: dict[int, list[tuple[Request, int]]] = {}
        num_running = 0
        for request in self.live.values():
            assert self.scheduler.get_request(request.request_id) is request
            assert request.num_tokens <= self.max_model_len
            blocks = self.manager.get_blocks(request.request_id)
            if request.status != RequestStatus.RUNNING:
                assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                assert not blocks and request.num_computed_tokens == 0
                continue
            num_running += 1
            assert len(blocks) * BLOCK_SIZE >= request.num_computed_tokens
            for index, block in enumerate(blocks):
                owners.setdefault(block.block_id, []).append((request, index))
        assert num_running == self.scheduler.num_running
        assert len(self.live) == num_running + self.scheduler.num_waiting
        assert 0 not in owners and pool.null_block.ref_cnt == 0
        for block in pool.blocks[1:]:
            holders = owners.get(block.block_id, [])
            assert block.ref_cnt == len(holders)
            if len(holders) > 1:
                assert block.block_hash is not None
            if block.block_hash is not None:
                for request, index in holders:
                    assert request.block_hashes[index] == block.block_hash
        assert pool.num_free_blocks + len(owners) == pool.num_usable_blocks

    def check_end(self) -> None:
        assert not self.live and not self.arrivals
        assert all(request.is_finished for request in self.all_requests)
        assert (
            set(self.reported_finished)
            == self.finished
            == {r.request_id for r in self.all_requests}
        )
        assert all(count == 1 for count in self.reported_finished.values())
        assert self.manager.num_free_blocks == self.manager.block_pool.num_usable_blocks


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("caching", "chunked"), [(True, True), (False, True), (True, False)])
def test_random_simulation_keeps_invariants(seed: int, caching: bool, chunked: bool) -> None:
    sim = _Simulation(seed, caching=caching, chunked=chunked)
    sim.run()
    sim.check_end()
    assert sum(r.num_preemptions for r in sim.all_requests) > 0
    if caching:
        assert sim.manager.prefix_cache_hits > 0
