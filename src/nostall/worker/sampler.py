"""Token sampling over a batch with per-row parameters, in plain tensor operations.

Every per-request knob is a tensor row, so one call serves a batch that mixes greedy and random
rows, different temperatures, top-k/top-p/min-p and penalties, and never looks at a GPU value from
the host. Randomness comes from `kernels.ref.random` (a function of seed and step), so a seeded
request draws the same tokens whatever else is in the batch.

Logprobs are those of the raw model distribution (log-softmax of the logits before penalties,
temperature and truncation), as vLLM reports them by default.
"""

from __future__ import annotations

import dataclasses

import torch

from nostall.kernels.ref.random import exponential_noise
from nostall.sampling_params import GREEDY_EPS


@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling parameters for R rows, on the logits' device."""

    temperature: torch.Tensor  # [R] float32; < GREEDY_EPS means greedy
    top_k: torch.Tensor  # [R] int64; vocab size when unlimited
    top_p: torch.Tensor  # [R] float32 in (0, 1]
    min_p: torch.Tensor  # [R] float32 in [0, 1]
    seeds: torch.Tensor  # [R] int64
    steps: torch.Tensor  # [R] int64: tokens this row's sequence has generated so far
    # Penalties: None when no row uses any.
    repetition_penalty: torch.Tensor | None = None  # [R] float32
    presence_penalty: torch.Tensor | None = None  # [R] float32
    frequency_penalty: torch.Tensor | None = None  # [R] float32
    output_counts: torch.Tensor | None = None  # [R, V] float32: occurrences in the output so far
    prompt_mask: torch.Tensor | None = None  # [R, V] bool: token occurs in the prompt
    # [R, V] bool: tokens that may not be sampled now (stop tokens before min_tokens); None if none.
    banned: torch.Tensor | None = None
    # Host-side facts about the batch, known when it is built; they only skip work.
    all_greedy: bool = False
    use_truncation: bool = True
    # Top alternatives to return per row (0 = only the sampled token); None = no logprobs at all.
    num_logprobs: int | None = None


@dataclasses.dataclass
class LogprobsTensors:
    # [R, 1 + N]: the sampled token first, then the top-N tokens by raw logprob.
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    # [R]: 1-based rank of the sampled token in the raw distribution.
    sampled_rank: torch.Tensor


@dataclasses.dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: LogprobsTensors | None


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Sample one token per row of float32 logits [R, V]."""
    raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.num_logprobs is not None else None
    logits = apply_penalties(logits, batch)
    if batch.banned is not None:
        logits = logits.masked_fill(batch.banned, float("-inf"))
    greedy_ids = argmax_rows(logits)
    if batch.all_greedy:
        token_ids = greedy_ids
    else:
        greedy = batch.temperature < GREEDY_EPS
        temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
        scaled = logits / temperature[:, None]
        if batch.use_truncation:
            scaled = apply_top_k_top_p_min_p(scaled, batch.top_k, batch.top_p, batch.min_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = exponential_noise(batch.seeds, batch.steps, probs.shape[-1])
        random_ids = (probs / noise).argmax(dim=-1)
        token_ids = torch.where(greedy, greedy_ids, random_ids)
    logprobs = None
    if raw_logprobs is not None and batch.num_logprobs is not None:
        logprobs = gather_logprobs(raw_logprobs, token_ids, batch.num_logprobs)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


# Columns per chunk in the first pass of argmax_rows.
_ARGMAX_CHUNK = 1024


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [R, V], in two passes so one long row spreads over many blocks.

    A single-pass reduction of a 128k-wide row runs on one block per row (about 35 us on an H200
    at batch 1). Ties resolve to the lowest index, as torch.argmax does: the first pass keeps each
    chunk's first maximum, the second the first chunk holding the overall maximum.
    """
    rows, vocab = logits.shape
    if vocab <= 4 * _ARGMAX_CHUNK:
        return logits.argmax(dim=-1)
    chunks = -(-vocab // _ARGMAX_CHUNK)
    padded = torch.nn.functional.pad(
        logits, (0, chunks * _ARGMAX_CHUNK - vocab), value=float("-inf")
    )
    values, within = padded.view(rows, chunks, _ARGMAX_CHUNK).max(dim=-1)
    best_chunk = values.argmax(dim=-1, keepdim=True)
    return (best_chunk * _ARGMAX_CHUNK + within.gather(-1, best_chunk)).squeeze(-1)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM semantics: repetition over prompt and output tokens; presence/frequency over output."""
    if batch.output_counts is None:
        return logits
    assert batch.prompt_mask is not None and batch.repetition_penalty is not None
    assert batch.presence_penalty is not None and batch.frequency_penalty is not None
    counts = batch.output_counts
    seen = batch.prompt_mask | (counts > 0)
    rep = batch.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - batch.frequency_penalty[:, None] * counts
    return logits - batch.presence_penalty[:, None] * (counts > 0).to(logits.dtype)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, top-p nucleus and min-p floor.

    The most likely token always survives. Top-p keeps the smallest prefix of tokens (by
    probability, after top-k) whose mass reaches top_p.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = drop | ((mass_before >= top_p[:, None]) & (top_p[:, None] < 1))
    drop = drop | (probs < min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> LogprobsTensors:
    sampled = raw_logprobs.gather(-1, token_ids[:, None])
    rank = (raw_logprobs > sampled).sum(dim=-1) + 1
    if num_top > 0:
        top_lp, top_ids = raw_logprobs.topk(num_top, dim=-1)
        ids = torch.cat([token_ids[:, None], top_ids], dim=-1)
        lps = torch.cat([sampled, top_lp], dim=-1)
    else:
        ids, lps = token_ids[:, None], sampled
    return LogprobsTensors(token_ids=ids, logprobs=lps, sampled_rank=rank)
