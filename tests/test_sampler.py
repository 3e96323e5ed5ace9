"""The sampler and its counter-based noise, against direct formulations on random logits."""

from __future__ import annotations

import math

import pytest
import torch

from nostall.kernels.ref.random import mix32, uniform_noise
from nostall.worker.sampler import SamplingBatch, apply_penalties, sample

V = 50


def _batch(r: int, **kw: object) -> SamplingBatch:
    base: dict[str, object] = dict(
        temperature=torch.ones(r),
        top_k=torch.full((r,), V, dtype=torch.int64),
        top_p=torch.ones(r),
        min_p=torch.zeros(r),
        seeds=torch.arange(r, dtype=torch.int64) * 7919 + 1,
        steps=torch.zeros(r, dtype=torch.int64),
    )
    base.update(kw)
    return SamplingBatch(**base)  # type: ignore[arg-type]


def test_mix32_is_a_bijection_on_a_sample_and_exact() -> None:
    x = torch.randint(0, 2**32, (20000,), dtype=torch.int64)
    x = torch.unique(x)
    h = mix32(x)
    assert h.min() >= 0 and h.max() < 2**32
    assert torch.unique(h).numel() == x.numel()

    # Python big-int reference of the same function.
    def ref(v: int) -> int:
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)

    for v in x[:200].tolist():
        assert int(mix32(torch.tensor([v]))[0]) == ref(v)


def test_uniform_noise_range_determinism_and_spread() -> None:
    seeds = torch.randint(0, 2**62, (4,), dtype=torch.int64)
    steps = torch.randint(0, 1000, (4,), dtype=torch.int64)
    u = uniform_noise(seeds, steps, 4096)
    assert u.dtype == torch.float32 and (u > 0).all() and (u < 1).all()
    assert torch.equal(u, uniform_noise(seeds, steps, 4096))
    # Row i does not depend on the other rows.
    assert torch.equal(u[2:3], uniform_noise(seeds[2:3], steps[2:3], 4096))
    # Another step or seed gives another stream.
    assert not torch.equal(u[0], uniform_noise(seeds[:1], steps[:1] + 1, 4096)[0])
    # Roughly uniform: mean 1/2, variance 1/12 (16k samples: 5-sigma bounds).
    flat = u.flatten()
    assert abs(flat.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / flat.numel())
    assert abs(flat.var().item() - 1 / 12) < 0.005
    hist = torch.histc(flat, bins=16, min=0, max=1)
    expected = flat.numel() / 16
    chi2 = ((hist - expected) ** 2 / expected).sum().item()
    assert chi2 < 50  # 15 degrees of freedom: p < 1e-5 for a fair generator


def test_greedy_rows_take_argmax() -> None:
    logits = torch.randn(6, V)
    out = sample(logits, _batch(6, temperature=torch.zeros(6), all_greedy=True))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    mixed = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.5])
    out = sample(logits, _batch(6, temperature=mixed))
    greedy = mixed == 0
    assert torch.equal(out.token_ids[greedy], logits.argmax(-1)[greedy])


def _empirical(logits_row: torch.Tensor, n: int, **kw: object) -> torch.Tensor:
    """Token frequencies over n independent seeds for one row of logits."""
    logits = logits_row.expand(n, -1).contiguous()
    batch = _batch(n, **kw)
    batch.seeds = torch.randint(0, 2**62, (n,), dtype=torch.int64)
    ids = sample(logits, batch).token_ids
    return torch.bincount(ids, minlength=logits.shape[-1]).float() / n


def _expand(v: float | int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((n,), v, dtype=dtype)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_sampling_follows_the_tempered_distribution(temperature: float) -> None:
    torch.manual_seed(int(temperature * 10))
    row = torch.randn(8) * 1.5
    n = 40000
    freq = _empirical(row, n, temperature=_expand(temperature, n), top_k=_expand(8, n, torch.int64))
    p = torch.softmax(row / temperature, -1)
    # Per-token 5-sigma binomial bound.
    assert ((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / n) + 1e-4).all(), (freq, p)


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    torch.manual_seed(1)
    row = torch.randn(V) * 2
    n = 20000
    order = row.argsort(descending=True)
    p = torch.softmax(row, -1)

    freq = _empirical(row, n, top_k=_expand(3, n, torch.int64), use_truncation=True)
    assert freq[order[3:]].sum() == 0
    kept = p[order[:3]] / p[order[:3]].sum()
    assert (freq[order[:3]] - kept).abs().max() < 0.03

    # top_p: the smallest prefix whose mass reaches 0.6.
    cum = p[order].cumsum(0)
    k = int((cum < 0.6).sum()) + 1
    freq = _empirical(row, n, top_p=_expand(0.6, n), use_truncation=True)
    assert freq[order[k:]].sum() == 0 and freq[order[k - 1]] > 0

    freq = _empirical(row, n, min_p=_expand(0.3, n), use_truncation=True)
    assert (freq[p < 0.3 * p.max()] == 0).all()


def test_seeded_row_is_independent_of_the_batch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(5, V)
    batch = _batch(5, steps=torch.arange(5, dtype=torch.int64) * 3)
    full = sample(logits, batch).token_ids
    for i in range(5):
        one = _batch(1, seeds=batch.seeds[i : i + 1], steps=batch.steps[i : i + 1])
        assert int(sample(logits[i : i + 1], one).token_ids[0]) == int(full[i])


def test_penalties_match_a_direct_formulation() -> None:
    torch.manual_seed(3)
    r = 3
    logits = torch.randn(r, V) * 3
    counts = torch.randint(0, 3, (r, V)).float() * (torch.rand(r, V) < 0.2)
    prompt_mask = torch.rand(r, V) < 0.1
    rep = torch.tensor([1.0, 1.3, 0.8])
    pres = torch.tensor([0.0, 0.5, -0.4])
    freq = torch.tensor([0.2, 0.0, 1.1])
    batch = _batch(
        r,
        output_counts=counts,
        prompt_mask=prompt_mask,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
    )
    got = apply_penalties(logits, batch)
    want = logits.clone()
    for i in range(r):
        for t in range(V):
            x = want[i, t].item()
            if prompt_mask[i, t] or counts[i, t] > 0:
                x = x / rep[i].item() if x > 0 else x * rep[i].item()
            x -= freq[i].item() * counts[i, t].item()
            x -= pres[i].item() * float(counts[i, t] > 0)
            want[i, t] = x
    torch.testing.assert_close(got, want)


def test_banned_tokens_are_never_sampled_and_logprobs_are_raw() -> None:
    torch.manual_seed(4)
    r = 4
    logits = torch.randn(r, V)
    banned = torch.zeros(r, V, dtype=torch.bool)
    banned[torch.arange(r), logits.argmax(-1)] = True
    out = sample(logits, _batch(r, temperature=torch.zeros(r), banned=banned, num_logprobs=3))
    assert not banned[torch.arange(r), out.token_ids].any()
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs is not None
    torch.testing.assert_close(
        out.logprobs.logprobs[:, 0], raw.gather(-1, out.token_ids[:, None])[:, 0]
    )
    # The argmax was banned, so the greedy pick is the raw runner-up: rank 2.
    assert out.logprobs.sampled_rank.tolist() == [2] * r
    top_lp, top_ids = raw.topk(3, -1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], top_lp)


@pytest.mark.parametrize("vocab", [50, 4096, 5000, 128256])
def test_argmax_rows_equals_torch_argmax_including_ties(vocab: int) -> None:
    from nostall.worker.sampler import argmax_rows

    torch.manual_seed(vocab)
    logits = torch.randn(7, vocab)
    # Ties: the maximum repeated across chunks and within one; the first index must win.
    logits[1, :] = 0.0
    logits[2, vocab // 3] = logits[2, vocab - 1] = 100.0
    logits[3, 5] = logits[3, 6] = 50.0
    logits[4, -1] = 1e9
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
