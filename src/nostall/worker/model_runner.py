"""Runs one scheduled step on the model: builds the flat batch, runs the forward, samples.

This is the plain-PyTorch runner (CPU, or a GPU without the zero-stall machinery). It rebuilds
the step's inputs from the scheduler's requests every step and returns device tensors; the engine
brings them to the host.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from nostall.config import CacheConfig, ModelConfig, SchedulerConfig
from nostall.errors import ConfigError
from nostall.layers.attention.backend import get_attention_backend
from nostall.layers.attention.metadata import AttentionContext, AttentionMetadata, KVCache
from nostall.models.loader import load_model
from nostall.scheduler.output import ScheduledRequest, SchedulerOutput
from nostall.scheduler.request import Request
from nostall.worker.sampler import LogprobsTensors, SamplingBatch, gather_logprobs, sample

logger = logging.getLogger(__name__)

# KV budget on the CPU when none is given (vLLM's CPU backend uses the same default).
DEFAULT_CPU_KV_BYTES = 4 << 30


@dataclasses.dataclass
class PromptLogprobsChunk:
    # Index of the prompt token the first row scores (>= 1: nothing scores token 0).
    start: int
    logprobs: LogprobsTensors


@dataclasses.dataclass
class ModelRunnerOutput:
    # Requests that sampled a token this step, in row order of the tensors below.
    req_ids: list[str]
    sampled_token_ids: torch.Tensor  # [R] int64
    logprobs: LogprobsTensors | None  # rows for every request in req_ids (None if none asked)
    prompt_logprobs: dict[str, PromptLogprobsChunk]


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        stop_token_ids: tuple[int, ...],
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = device
        # Token ids that min_tokens holds back (EOS unless ignore_eos; stop_token_ids are per request).
        self.eos_token_ids = stop_token_ids
        self.model = load_model(model_config, device)
        self.backend = get_attention_backend("torch")
        self.kv_caches: list[KVCache] = []
        self.vocab_size = model_config.vocab_size

    # ---- KV cache sizing ------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        elem = torch.empty((), dtype=mc.dtype).element_size()
        return (
            2 * mc.num_layers * self.cache_config.block_size * mc.num_kv_heads * mc.head_dim * elem
        )

    def determine_num_blocks(self) -> int:
        cc = self.cache_config
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        elif cc.kv_cache_memory_bytes is not None:
            num_blocks = cc.kv_cache_memory_bytes // self.kv_bytes_per_block
        elif self.device.type == "cuda":
            num_blocks = self._profile_gpu_blocks()
        else:
            num_blocks = DEFAULT_CPU_KV_BYTES // self.kv_bytes_per_block
        return num_blocks

    def _profile_gpu_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization of the device after a worst-case forward."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        num_tokens = min(
            self.scheduler_config.max_num_batched_tokens, self.scheduler_config.max_model_len
        )
        blocks = -(-num_tokens // self.cache_config.block_size) + 1
        self.initialize_kv_cache(blocks)
        req_blocks = list(range(1, blocks))
        meta = self._metadata([(0, num_tokens, req_blocks)], num_tokens)
        with torch.inference_mode():
            hidden = self.model(
                torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                torch.arange(num_tokens, device=self.device),
                AttentionContext(meta, self.kv_caches, self.backend),
            )
            self.model.compute_logits(hidden[: self.scheduler_config.max_num_seqs])
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

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        shape = (num_blocks, self.cache_config.block_size, mc.num_kv_heads, mc.head_dim)
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

    # ---- one step -------------------------------------------------------------------------

    def _metadata(
        self, reqs: list[tuple[int, int, list[int]]], num_tokens: int
    ) -> AttentionMetadata:
        """Metadata for requests given as (num_computed_before, num_new_tokens, block_ids)."""
        bs = self.cache_config.block_size
        qsl = [0]
        seq_lens: list[int] = []
        slots: list[int] = []
        for before, n, block_ids in reqs:
            qsl.append(qsl[-1] + n)
            seq_lens.append(before + n)
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(before, before + n))
        assert qsl[-1] == num_tokens
        width = max(len(b) for _, _, b in reqs)
        tables = [b + [0] * (width - len(b)) for _, _, b in reqs]
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        dev = self.device
        return AttentionMetadata(
            query_start_loc=qsl_cpu.to(dev),
            seq_lens=seq_lens_cpu.to(dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=max(n for _, n, _ in reqs),
            max_seq_len=max(seq_lens),
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = sched.scheduled
        token_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampling_reqs: list[ScheduledRequest] = []
        # (request, first flat row, first prompt token scored, count)
        prompt_lp_rows: list[tuple[ScheduledRequest, int, int, int]] = []
        for s in scheduled:
            req, before, n = s.request, s.num_computed_before, s.num_new_tokens
            first_row = len(token_ids)
            token_ids.extend(req.all_token_ids[before : before + n])
            positions.extend(range(before, before + n))
            if before + n == req.num_tokens:
                sample_rows.append(first_row + n - 1)
                sampling_reqs.append(s)
            if req.sampling_params.prompt_logprobs is not None:
                # Row p scores prompt token p + 1.
                count = min(before + n, req.num_prompt_tokens - 1) - before
                if count > 0:
                    prompt_lp_rows.append((s, first_row, before + 1, count))

        meta = self._metadata(
            [(s.num_computed_before, s.num_new_tokens, s.block_ids) for s in scheduled],
            len(token_ids),
        )
        dev = self.device
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            AttentionContext(meta, self.kv_caches, self.backend),
        )

        req_ids = [s.request.request_id for s in sampling_reqs]
        if sampling_reqs:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
            out = sample(logits, self._sampling_batch([s.request for s in sampling_reqs]))
            sampled, logprobs = out.token_ids, out.logprobs
        else:
            sampled, logprobs = torch.empty(0, dtype=torch.long, device=dev), None

        prompt_logprobs: dict[str, PromptLogprobsChunk] = {}
        for s, first_row, start, count in prompt_lp_rows:
            req = s.request
            assert req.sampling_params.prompt_logprobs is not None
            logits = self.model.compute_logits(hidden[first_row : first_row + count])
            targets = torch.tensor(req.prompt_token_ids[start : start + count], device=dev)
            prompt_logprobs[req.request_id] = PromptLogprobsChunk(
                start=start,
                logprobs=gather_logprobs(
                    torch.log_softmax(logits, dim=-1), targets, req.sampling_params.prompt_logprobs
                ),
            )
        return ModelRunnerOutput(req_ids, sampled, logprobs, prompt_logprobs)

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        dev = self.device
        params = [r.sampling_params for r in reqs]
        vocab = self.vocab_size
        f32 = torch.float32

        def col(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        batch = SamplingBatch(
            temperature=col([p.temperature for p in params], f32),
            top_k=col([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64),
            top_p=col([p.top_p for p in params], f32),
            min_p=col([p.min_p for p in params], f32),
            seeds=col([r.seed for r in reqs], torch.int64),
            steps=col([r.num_output_tokens for r in reqs], torch.int64),
            all_greedy=all(p.greedy for p in params),
            use_truncation=any(
                not p.greedy and (0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0) for p in params
            ),
        )
        if any(
            p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
            for p in params
        ):
            counts = torch.zeros(len(reqs), vocab, dtype=f32, device=dev)
            prompt_mask = torch.zeros(len(reqs), vocab, dtype=torch.bool, device=dev)
            for i, r in enumerate(reqs):
                if r.output_token_ids:
                    ids = torch.tensor(r.output_token_ids, device=dev)
                    counts[i].scatter_add_(0, ids, torch.ones(len(ids), dtype=f32, device=dev))
                prompt_mask[i, torch.tensor(r.prompt_token_ids, device=dev)] = True
            batch.output_counts = counts
            batch.prompt_mask = prompt_mask
            batch.repetition_penalty = col([p.repetition_penalty for p in params], f32)
            batch.presence_penalty = col([p.presence_penalty for p in params], f32)
            batch.frequency_penalty = col([p.frequency_penalty for p in params], f32)
        banned_rows: list[tuple[int, int]] = []
        for i, (r, p) in enumerate(zip(reqs, params, strict=True)):
            if r.num_output_tokens < p.min_tokens:
                held = list(p.stop_token_ids or []) + (
                    [] if p.ignore_eos else list(self.eos_token_ids)
                )
                banned_rows.extend((i, t) for t in held if t < vocab)
        if banned_rows:
            banned = torch.zeros(len(reqs), vocab, dtype=torch.bool, device=dev)
            rows = torch.tensor([r for r, _ in banned_rows], device=dev)
            cols = torch.tensor([c for _, c in banned_rows], device=dev)
            banned[rows, cols] = True
            batch.banned = banned
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        batch.num_logprobs = max(wanted) if wanted else None
        return batch
