"""Runs scheduled steps on the model without making the host wait for the device.

Per step the host uploads small deltas (new requests, new block ids) and three ints per scheduled
request (slot, tokens already computed, tokens to compute); everything else - input ids, positions,
slot mapping, sequence lengths, block tables - is built on the device from the persistent
`RequestState`. The sampler writes each new token into the state, where the next step reads it.
Results travel back through a non-blocking copy on a side stream; `StepOutput.result()` waits on
its event, so the engine can plan and launch step N+1 before it looks at step N.

Decode steps (one token per request) replay a CUDA graph of the whole step - input preparation,
every layer, logits and, for greedy batches, sampling and the token write-back - captured for a
list of batch sizes, padded up. Prefill and mixed steps run eagerly. On the CPU the same code runs
eagerly and synchronously.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from nostall.config import CacheConfig, ModelConfig, SchedulerConfig
from nostall.errors import ConfigError
from nostall.layers.attention.backend import get_attention_backend
from nostall.layers.attention.metadata import (
    AttentionContext,
    AttentionMetadata,
    KVCache,
    build_metadata,
)
from nostall.models.loader import load_model
from nostall.scheduler.output import SchedulerOutput
from nostall.worker.request_state import RequestState, to_device, uses_penalties
from nostall.worker.sampler import (
    LogprobsTensors,
    SamplingBatch,
    argmax_rows,
    gather_logprobs,
    sample,
)

logger = logging.getLogger(__name__)

# KV budget on the CPU when none is given (vLLM's CPU backend uses the same default).
DEFAULT_CPU_KV_BYTES = 4 << 30
# Decode batch sizes captured as CUDA graphs (those up to max_num_seqs).
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclasses.dataclass
class PromptLogprobsChunk:
    # Index of the prompt token the first row scores (>= 1: nothing scores token 0).
    start: int
    logprobs: LogprobsTensors


@dataclasses.dataclass
class ModelRunnerOutput:
    """One step's results on the host."""

    # Requests that sampled a token this step, in row order of the tensors below.
    req_ids: list[str]
    sampled_token_ids: torch.Tensor  # [R] int64
    logprobs: LogprobsTensors | None  # rows for every request in req_ids (None if none asked)
    prompt_logprobs: dict[str, PromptLogprobsChunk]


class StepOutput:
    """A launched step whose results are on their way to the host."""

    def __init__(
        self, output: ModelRunnerOutput, event: torch.cuda.Event | None, keep: object
    ) -> None:
        self._output = output
        self._event = event
        # Requests that sample a token in this step (known at launch).
        self.req_ids = output.req_ids
        # Device tensors the copies read from, alive until the copies are done.
        self._keep = keep

    def result(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            self._keep = None
        return self._output


@dataclasses.dataclass
class _Plan:
    """The host's view of one step: what it uploads and what it expects back."""

    num_tokens: int
    # Cumulative query lengths [R + 1].
    qsl: list[int]
    slots: list[int]
    num_computed: list[int]
    num_new: list[int]
    # Indices (into the scheduled list) of the requests that sample a token this step.
    sample_reqs: list[int]
    req_ids: list[str]
    # (request index, first scored prompt token, count) for prompt logprobs.
    prompt_lp: list[tuple[int, int, int]]


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        stop_token_ids: tuple[int, ...],
        attention_backend: str = "auto",
        enforce_eager: bool = False,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = device
        # Token ids that min_tokens holds back (EOS unless ignore_eos; stop_token_ids are per request).
        self.eos_token_ids = stop_token_ids
        self.model = load_model(model_config, device)
        if attention_backend == "auto":
            attention_backend = "triton" if device.type == "cuda" else "torch"
        self.backend = get_attention_backend(attention_backend)
        # Graphs need a backend that reads no host values per step.
        self.use_graphs = (
            device.type == "cuda" and not enforce_eager and attention_backend != "torch"
        )
        self.vocab_size = model_config.vocab_size
        self.block_size = cache_config.block_size
        self.kv_caches: list[KVCache] = []
        self.state: RequestState | None = None
        # (batch size, greedy) -> (graph, its output: sampled ids if greedy, else logits).
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_sizes: list[int] = []
        self._static_inputs = torch.empty(0, dtype=torch.int64)
        self._static_ones = torch.empty(0, dtype=torch.int64)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ---- KV cache sizing ------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        elem = torch.empty((), dtype=mc.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def determine_num_blocks(self) -> int:
        cc = self.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes // self.kv_bytes_per_block
        if self.device.type == "cuda":
            return self._profile_gpu_blocks()
        return DEFAULT_CPU_KV_BYTES // self.kv_bytes_per_block

    def _profile_gpu_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization of the device after a worst-case forward."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        sc = self.scheduler_config
        num_tokens = min(sc.max_num_batched_tokens, sc.max_model_len)
        blocks = -(-num_tokens // self.block_size) + 1
        self._allocate_kv(blocks)
        meta = build_metadata(
            [num_tokens], [num_tokens], [list(range(1, blocks))], self.block_size, self.device
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                torch.arange(num_tokens, device=self.device),
                AttentionContext(meta, self.kv_caches, self.backend),
            )
            self.model.compute_logits(hidden[: sc.max_num_seqs])
        torch.cuda.synchronize(self.device)
        self.kv_caches = []
        peak = torch.cuda.max_memory_allocated(self.device)
        budget = int(total * self.cache_config.gpu_memory_utilization) - non_torch - peak
        num_blocks = budget // self.kv_bytes_per_block
        if num_blocks < 2:
            raise ConfigError(
                f"no room for the KV cache: gpu_memory_utilization={self.cache_config.gpu_memory_utilization}"
                f" of {total / 2**30:.1f} GiB leaves {budget / 2**30:.2f} GiB after weights and activations;"
                " raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return num_blocks

    def _allocate_kv(self, num_blocks: int) -> None:
        mc = self.model_config
        shape = (num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        # The reference attention never reads a slot nothing wrote, so CPU caches stay unzeroed
        # (no page is touched before use); GPU kernels may read masked garbage, so zero there.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        self.kv_caches = [
            KVCache(
                key=alloc(shape, dtype=mc.dtype, device=self.device),
                value=alloc(shape, dtype=mc.dtype, device=self.device),
            )
            for _ in range(mc.num_layers)
        ]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and the request state; capture the decode graphs."""
        self._allocate_kv(num_blocks)
        sc = self.scheduler_config
        self.state = RequestState(
            sc.max_num_seqs,
            sc.max_model_len,
            -(-sc.max_model_len // self.block_size),
            self.vocab_size,
            self.device,
        )
        if self.use_graphs:
            self._capture_graphs()

    # ---- one step -------------------------------------------------------------------------

    def _sync_state(self, sched: SchedulerOutput) -> None:
        state = self.state
        assert state is not None
        for rid in (*sched.finished_request_ids, *sched.preempted_request_ids):
            state.remove(rid)
        state.add([(s.request, s.block_ids) for s in sched.scheduled if s.is_new])
        state.append_blocks(
            [(s.request.request_id, s.new_block_ids) for s in sched.scheduled if not s.is_new]
        )

    def _plan(self, sched: SchedulerOutput) -> _Plan:
        state = self.state
        assert state is not None
        plan = _Plan(0, [0], [], [], [], [], [], [])
        for i, s in enumerate(sched.scheduled):
            req = s.request
            before, n = s.num_computed_before, s.num_new_tokens
            plan.slots.append(state.slot_of[req.request_id])
            plan.num_computed.append(before)
            plan.num_new.append(n)
            plan.qsl.append(plan.qsl[-1] + n)
            if before + n == req.num_tokens_with_pending:
                plan.sample_reqs.append(i)
                plan.req_ids.append(req.request_id)
            if req.sampling_params.prompt_logprobs is not None:
                # Row p scores prompt token p + 1.
                count = min(before + n, req.num_prompt_tokens - 1) - before
                if count > 0:
                    plan.prompt_lp.append((i, before + 1, count))
        plan.num_tokens = plan.qsl[-1]
        return plan

    def _prepare(
        self,
        slots: torch.Tensor,
        num_computed: torch.Tensor,
        num_new: torch.Tensor,
        num_tokens: int,
        host: tuple[torch.Tensor, torch.Tensor, int, int],
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata, built on the device (graph-capturable).

        slots, num_computed, num_new: [R] int64 per scheduled request; host: the host copies of
        query_start_loc and seq_lens and the max query/sequence length, for backends that want them.
        """
        state = self.state
        assert state is not None
        r = slots.shape[0]
        dev = self.device
        qsl = torch.zeros(r + 1, dtype=torch.int32, device=dev)
        qsl[1:] = torch.cumsum(num_new, 0)
        req_of = torch.repeat_interleave(
            torch.arange(r, device=dev), num_new, output_size=num_tokens
        )
        positions = num_computed[req_of] + torch.arange(num_tokens, device=dev) - qsl[req_of]
        slot_of = slots[req_of]
        input_ids = state.token_ids[slot_of, positions]
        tables = state.block_table[slots]
        bs = self.block_size
        slot_mapping = tables[req_of, positions // bs].to(torch.int64) * bs + positions % bs
        qsl_cpu, seq_lens_cpu, max_q, max_s = host
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=(num_computed + num_new).to(torch.int32),
            block_tables=tables,
            slot_mapping=slot_mapping,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=max_q,
            max_seq_len=max_s,
        )
        return input_ids, positions, meta

    def _write_back(
        self, slots: torch.Tensor, seq_lens: torch.Tensor, sampled: torch.Tensor
    ) -> None:
        """The sampled token of each row becomes the next input of its request."""
        assert self.state is not None
        self.state.token_ids[slots, seq_lens] = sampled

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepOutput:
        self._sync_state(sched)
        plan = self._plan(sched)
        dev = self.device
        r = len(plan.slots)
        all_sample = len(plan.sample_reqs) == r
        graph_size = (
            self._graph_size(r)
            if plan.num_tokens == r and all_sample and not plan.prompt_lp
            else None
        )
        hidden: torch.Tensor | None = None
        logits: torch.Tensor | None = None
        sampled: torch.Tensor | None = None
        if graph_size is not None:
            # Decode: every request runs one token and samples. One upload fills the graph's
            # static inputs, padded rows pointing at the padding slot.
            assert self.state is not None
            pad = graph_size - r
            static = to_device(
                plan.slots + [self.state.pad_slot] * pad + plan.num_computed + [0] * pad,
                torch.int64,
                dev,
            )
            self._static_inputs[: 2 * graph_size].copy_(static)
            greedy_graph = not self._needs_full_sampler(sched, plan) and all(
                sched.scheduled[i].request.sampling_params.greedy for i in plan.sample_reqs
            )
            graph, out = self._graphs[(graph_size, greedy_graph)]
            graph.replay()
            if greedy_graph:
                sampled = out[:r]
            else:
                logits = out[:r]
                s_slots = static[:r]
                s_seq_lens = static[graph_size : graph_size + r] + 1
        else:
            upload = to_device(
                plan.slots
                + plan.num_computed
                + plan.num_new
                + [plan.qsl[i + 1] - 1 for i in plan.sample_reqs]
                + plan.sample_reqs,
                torch.int64,
                dev,
            )
            slots, num_computed, num_new = upload[:r], upload[r : 2 * r], upload[2 * r : 3 * r]
            num_s = len(plan.sample_reqs)
            last_rows = upload[3 * r : 3 * r + num_s]
            sample_idx = upload[3 * r + num_s :]
            host = self._host_metadata(plan)
            input_ids, positions, meta = self._prepare(
                slots, num_computed, num_new, plan.num_tokens, host
            )
            hidden = self.model(
                input_ids, positions, AttentionContext(meta, self.kv_caches, self.backend)
            )
            if num_s:
                logits = self.model.compute_logits(hidden[last_rows])
                s_slots = slots[sample_idx]
                s_seq_lens = (num_computed + num_new)[sample_idx]

        logprobs = None
        if logits is not None:
            batch = self._sampling_batch(sched, plan, s_slots, s_seq_lens)
            result = sample(logits, batch)
            sampled, logprobs = result.token_ids, result.logprobs
            self._write_back(s_slots, s_seq_lens, sampled)
            self._count_outputs(s_slots, sampled)
        if sampled is None:
            sampled = torch.empty(0, dtype=torch.int64, device=dev)

        prompt_lp: dict[str, PromptLogprobsChunk] = {}
        if plan.prompt_lp:
            assert hidden is not None
            for i, start, count in plan.prompt_lp:
                req = sched.scheduled[i].request
                first = plan.qsl[i]
                lp_logits = self.model.compute_logits(hidden[first : first + count])
                targets = to_device(req.prompt_token_ids[start : start + count], torch.int64, dev)
                prompt_lp[req.request_id] = PromptLogprobsChunk(
                    start,
                    gather_logprobs(
                        torch.log_softmax(lp_logits, dim=-1),
                        targets,
                        req.sampling_params.prompt_logprobs or 0,
                    ),
                )
        return self._to_host(ModelRunnerOutput(plan.req_ids, sampled, logprobs, prompt_lp))

    def _host_metadata(self, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        seq_lens = [c + n for c, n in zip(plan.num_computed, plan.num_new, strict=True)]
        return (
            torch.tensor(plan.qsl, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            max(plan.num_new),
            max(seq_lens),
        )

    def _needs_full_sampler(self, sched: SchedulerOutput, plan: _Plan) -> bool:
        """Whether any sampling row needs more than greedy argmax (logprobs, bans, penalties)."""
        for i in plan.sample_reqs:
            req = sched.scheduled[i].request
            p = req.sampling_params
            if p.logprobs is not None or uses_penalties(p):
                return True
            if req.num_tokens_with_pending - req.num_prompt_tokens < p.min_tokens:
                return True
        return False

    def _sampling_batch(
        self, sched: SchedulerOutput, plan: _Plan, slots: torch.Tensor, seq_lens: torch.Tensor
    ) -> SamplingBatch:
        state = self.state
        assert state is not None
        reqs = [sched.scheduled[i].request for i in plan.sample_reqs]
        params = [r.sampling_params for r in reqs]
        vocab = self.vocab_size
        batch = SamplingBatch(
            temperature=state.temperature[slots],
            top_k=state.top_k[slots],
            top_p=state.top_p[slots],
            min_p=state.min_p[slots],
            seeds=state.seeds[slots],
            steps=seq_lens - state.prompt_len[slots],
            all_greedy=all(p.greedy for p in params),
            use_truncation=any(
                not p.greedy and (0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0) for p in params
            ),
        )
        if any(uses_penalties(p) for p in params):
            assert state.output_counts is not None and state.prompt_mask is not None
            batch.output_counts = state.output_counts[slots]
            batch.prompt_mask = state.prompt_mask[slots]
            batch.repetition_penalty = state.repetition_penalty[slots]
            batch.presence_penalty = state.presence_penalty[slots]
            batch.frequency_penalty = state.frequency_penalty[slots]
        banned_rows: list[int] = []
        banned_cols: list[int] = []
        for row, (r, p) in enumerate(zip(reqs, params, strict=True)):
            if r.num_tokens_with_pending - r.num_prompt_tokens < p.min_tokens:
                held = list(p.stop_token_ids or []) + (
                    [] if p.ignore_eos else list(self.eos_token_ids)
                )
                for t in held:
                    if t < vocab:
                        banned_rows.append(row)
                        banned_cols.append(t)
        if banned_rows:
            banned = torch.zeros(len(reqs), vocab, dtype=torch.bool, device=self.device)
            banned[
                to_device(banned_rows, torch.int64, self.device),
                to_device(banned_cols, torch.int64, self.device),
            ] = True
            batch.banned = banned
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        batch.num_logprobs = max(wanted) if wanted else None
        return batch

    def _count_outputs(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Penalty bookkeeping: occurrences of each token in each request's output."""
        state = self.state
        assert state is not None
        if state.output_counts is not None:
            state.output_counts.index_put_(
                (slots, sampled), torch.ones_like(sampled, dtype=torch.float32), accumulate=True
            )

    def _to_host(self, out: ModelRunnerOutput) -> StepOutput:
        """Start the copies of a step's results to the host; on the CPU they are already there."""
        if self._copy_stream is None:
            return StepOutput(out, None, None)
        main = torch.cuda.current_stream(self.device)
        tensors: list[torch.Tensor] = [out.sampled_token_ids]
        if out.logprobs is not None:
            lp = out.logprobs
            tensors += [lp.token_ids, lp.logprobs, lp.sampled_rank]
        for chunk in out.prompt_logprobs.values():
            lp = chunk.logprobs
            tensors += [lp.token_ids, lp.logprobs, lp.sampled_rank]
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        self._copy_stream.wait_stream(main)
        with torch.cuda.stream(self._copy_stream):
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        it = iter(host)
        result = ModelRunnerOutput(out.req_ids, next(it), None, {})
        if out.logprobs is not None:
            result.logprobs = LogprobsTensors(next(it), next(it), next(it))
        for rid, chunk in out.prompt_logprobs.items():
            result.prompt_logprobs[rid] = PromptLogprobsChunk(
                chunk.start, LogprobsTensors(next(it), next(it), next(it))
            )
        return StepOutput(result, event, tensors)

    # ---- CUDA graphs ----------------------------------------------------------------------

    def _graph_size(self, num_reqs: int) -> int | None:
        if not self._graphs:
            return None
        for size in self._graph_sizes:
            if size >= num_reqs:
                return size
        return None

    def _decode_body(self, size: int, greedy: bool) -> torch.Tensor:
        """One decode step of `size` requests on the static inputs: sampled ids or logits."""
        slots = self._static_inputs[:size]
        num_computed = self._static_inputs[size : 2 * size]
        num_new = self._static_ones[:size]
        host = (
            torch.arange(size + 1, dtype=torch.int32),
            torch.ones(size, dtype=torch.int32),
            1,
            self.scheduler_config.max_model_len,
        )
        input_ids, positions, meta = self._prepare(slots, num_computed, num_new, size, host)
        hidden = self.model(
            input_ids, positions, AttentionContext(meta, self.kv_caches, self.backend)
        )
        logits = self.model.compute_logits(hidden)
        if not greedy:
            return logits
        sampled = argmax_rows(logits)
        self._write_back(slots, num_computed + 1, sampled)
        return sampled

    def _capture_graphs(self) -> None:
        assert self.state is not None
        t0 = time.perf_counter()
        limit = self.scheduler_config.max_num_seqs
        self._graph_sizes = [s for s in CAPTURE_SIZES if s <= limit]
        if limit not in self._graph_sizes:
            self._graph_sizes.append(limit)
        largest = self._graph_sizes[-1]
        dev = self.device
        # Graph of batch size B reads its slots from [0, B) and computed lengths from [B, 2B).
        self._static_inputs = torch.zeros(2 * largest, dtype=torch.int64, device=dev)
        self._static_inputs[:largest] = self.state.pad_slot
        self._static_ones = torch.ones(largest, dtype=torch.int64, device=dev)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self._graph_sizes):
                for greedy in (True, False):
                    # Warm up (Triton compiles, cuBLAS picks its kernels) off the capture stream.
                    side = torch.cuda.Stream(dev)
                    side.wait_stream(torch.cuda.current_stream(dev))
                    with torch.cuda.stream(side):
                        self._decode_body(size, greedy)
                    torch.cuda.current_stream(dev).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._decode_body(size, greedy)
                    self._graphs[(size, greedy)] = (graph, out)
        torch.cuda.synchronize(dev)
        logger.info(
            "captured %d decode graphs (batch sizes %s) in %.1fs",
            len(self._graphs),
            ",".join(map(str, self._graph_sizes)),
            time.perf_counter() - t0,
        )
