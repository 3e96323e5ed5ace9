"""Counter-based random numbers for sampling: a pure function of (seed, step, token index).

A sampled token depends only on its own request's seed and how many tokens that request has
generated, never on what else is in the batch, on the device, or on a generator's hidden state.
That makes seeded sampling reproducible across batch compositions and preemption, and lets the
whole sampler live inside a CUDA graph (no generator state to advance on the host).

All arithmetic is on int64 tensors holding 32-bit values; products are split so that no
intermediate exceeds 2**49, so the result is exact and identical on every device.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x, c < 2**32, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (the "lowbias32" finalizer)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from a 64-bit seed and a step counter (both int64 [R])."""
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    return mix32(lo ^ mix32(hi ^ mix32(steps & _MASK32)))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, num_cols: int) -> torch.Tensor:
    """float32 [R, num_cols] uniform in (0, 1), a pure function of (seed, step, column)."""
    keys = row_keys(seeds.to(torch.int64), steps.to(torch.int64))
    cols = torch.arange(num_cols, device=seeds.device, dtype=torch.int64)
    h = mix32(mix32(cols + 0x9E3779B9)[None, :] ^ keys[:, None])
    # 24 random bits, centred in their bucket so the value is never 0 or 1.
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, num_cols: int) -> torch.Tensor:
    """float32 [R, num_cols] Exp(1) samples; argmax(p / E) draws an index with probability p."""
    return -torch.log(uniform_noise(seeds, steps, num_cols))
