"""Argument checks shared by the paged attention kernels (decode and prefill)."""

from __future__ import annotations

import torch


def check_attention_io(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] with unit stride over D (made so if needed) and the output to write: `out` if
    given (same shape, unit stride over D), else a new tensor like q. The caches must share
    strides, with unit stride over head_dim; H must be a multiple of the caches' KV heads."""
    num_heads, num_kv_heads = q.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError(
            f"key and value caches need equal strides with unit stride over head_dim, got "
            f"{key_cache.stride()} and {value_cache.stride()}"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(
            f"out has shape {tuple(out.shape)} and strides {out.stride()}; expected q's shape "
            f"{tuple(q.shape)} with unit stride over head_dim"
        )
    return q, out
