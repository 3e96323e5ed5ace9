"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

One policy for prefill and decode: each step hands out at most `max_num_batched_tokens` tokens,
first to the running requests (in admission order: a decode takes 1 token, an unfinished prefill
takes what is left of the budget), then, if no request was preempted, to waiting requests in FCFS
order. The scheduler decides from token counts alone (never from sampled values), so it can plan
a step before the previous one has finished on the GPU.

Invariants between calls:
- Every request known to the scheduler is either in `waiting` (WAITING or PREEMPTED, holding no
  blocks, `num_computed_tokens == 0`) or in `running` (RUNNING, holding blocks for at least its
  `num_computed_tokens` tokens); `len(running) <= max_num_seqs`.
- Finished requests are forgotten at once: they hold no blocks and appear in exactly one
  output's `finished_request_ids`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from nostall.errors import ConfigError, InvalidRequestError
from nostall.kv.kv_cache_manager import KVCacheManager
from nostall.scheduler.output import ScheduledRequest, SchedulerOutput
from nostall.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    # nostall.config imports torch (ModelConfig.dtype); the scheduler itself must not.
    from nostall.config import SchedulerConfig


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        # A request that cannot fit alone in the whole cache would be preempted and re-admitted
        # forever; refuse such a configuration up front.
        capacity = (kv_cache_manager.num_blocks - 1) * kv_cache_manager.block_size
        if capacity < config.max_model_len:
            raise ConfigError(
                f"max_model_len={config.max_model_len} does not fit in the KV cache: "
                f"{kv_cache_manager.num_blocks - 1} usable blocks of {kv_cache_manager.block_size}"
                f" tokens hold {capacity} tokens; lower max_model_len or give the cache more blocks"
            )
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions_total = 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def has_finished_requests(self) -> bool:
        """Finished ids not yet reported: one more schedule() call delivers them to the runner."""
        return bool(self._finished_ids)

    def get_request(self, request_id: str) -> Request | None:
        """The waiting or running request with this id; None once it has finished."""
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if not 1 <= request.num_tokens <= self.config.max_model_len:
            raise InvalidRequestError(
                f"request {request.request_id!r} has {request.num_tokens} tokens; accepted: 1 to"
                f" max_model_len={self.config.max_model_len}"
            )
        if request.status != RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise InvalidRequestError(
                f"request {request.request_id!r} is {request.status.name} with"
                f" {request.num_computed_tokens} computed tokens; accepted: a new WAITING request"
            )
        self._waiting.append(request)
        self._requests[request.request_id] = request

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Advances `num_computed_tokens` of every scheduled request by its tokens."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted_ids: list[str] = []

        # Running requests, oldest first. Victims are taken from the tail of `running`, which this
        # pass has not reached yet, so a request scheduled in this call is never preempted in it.
        i = 0
        while i < len(self._running) and budget > 0:
            request = self._running[i]
            num_new = min(request.num_tokens_with_pending - request.num_computed_tokens, budget)
            if num_new == 0:
                # Nothing sampled since its last step (a runner that did not sample it).
                i += 1
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new, preempted_ids)
            if new_block_ids is None:
                break
            scheduled.append(
                self._scheduled(
                    request, num_new, request.num_computed_tokens, new_block_ids, is_new=False
                )
            )
            budget -= num_new
            i += 1

        # Waiting requests, FCFS without skipping: a head that does not fit blocks the queue.
        while (
            not preempted_ids
            and self._waiting
            and budget > 0
            and len(self._running) < self.config.max_num_seqs
        ):
            request = self._waiting[0]
            # A preempted request is re-admitted only after its in-flight tokens arrived.
            assert request.num_pending_tokens == 0, request
            if request.sampling_params.prompt_logprobs is None:
                hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            else:
                # Prompt logprobs need the logits of every prompt position: no cache hits.
                hits, num_hit_tokens = [], 0
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, hits, num_hit_tokens
            )
            if new_block_ids is None:
                break
            self._waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            scheduled.append(
                self._scheduled(request, num_new, num_hit_tokens, new_block_ids, is_new=True)
            )
            budget -= num_new

        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=preempted_ids,
            finished_request_ids=finished_ids,
        )

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted_ids: list[str]
    ) -> list[int] | None:
        """Slots for `num_new` more tokens of a running request, preempting from the tail of
        `running` until they fit. None when `request` itself was the victim."""
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self._running.pop()
            self._preempt(victim)
            preempted_ids.append(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        """Recompute policy: drop all its KV; it goes back to the head of the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._waiting.appendleft(request)

    def _scheduled(
        self,
        request: Request,
        num_new_tokens: int,
        num_computed_before: int,
        new_block_ids: list[int],
        *,
        is_new: bool,
    ) -> ScheduledRequest:
        return ScheduledRequest(
            request=request,
            num_new_tokens=num_new_tokens,
            num_computed_before=num_computed_before,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id) if is_new else [],
            new_block_ids=new_block_ids,
            is_new=is_new,
        )

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests (stop, length or abort) from any state and free their blocks at once.

        Unknown or already finished ids are ignored.
        """
        if not status.finished:
            raise ValueError(f"status={status.name} is invalid; accepted: a FINISHED_* status")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            request = self._requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self._running.remove(request)
            else:
                self._waiting.remove(request)
            request.status = status
            self.kv_cache_manager.free(request)
            self._finished_ids.append(request_id)
