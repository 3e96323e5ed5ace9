"""Neox-style rotary embedding of queries and keys (twin of kernels/ref/rotary.py).

Layout: positions [T] int; q [T, H, D] and k [T, KVH, D] with unit stride over D (any token and
head strides, e.g. views into a fused QKV projection); cos_sin_cache [max_position, D] float32
holding [cos | sin] over D / 2 frequencies (layers/rotary.py's table). Each head's halves
(x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin). cos and sin are rounded to q's dtype first, as
transformers does; the rotation itself is computed in float32 and rounded once.
One program per token rotates all its query and key heads; output may alias input (in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    token,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
) -> None:
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (cols[None, :] < HALF)
    x_offsets = token * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    o_offsets = token * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + o_offsets, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out_ptr + o_offsets + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos_sin,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + position * stride_cos_sin
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(row + cols, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + cols, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        token,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        cos,
        sin,
        NUM_HEADS,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        token,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        cos,
        sin,
        NUM_KV_HEADS,
        HALF,
        BLOCK_KV_H,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int; q: [T, H, D]; k: [T, KVH, D] (same dtype); cos_sin_cache: [max_position, D]
    float32 [cos | sin]. Returns the rotated (q, k), written into out when given: pass out=(q, k)
    to rotate in place."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if cos_sin_cache.shape[1] != head_dim or head_dim % 2 != 0:
        raise ValueError(
            f"cos_sin_cache has {cos_sin_cache.shape[1]} columns for head_dim={head_dim}; "
            "accepted: an even head_dim equal to the table's width"
        )
    if q.dtype != k.dtype:
        raise ValueError(f"q and k dtypes differ: {q.dtype} and {k.dtype}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if out is None:
        out = (
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
        )
    q_out, k_out = out
    if q_out.stride(-1) != 1 or k_out.stride(-1) != 1:
        raise ValueError(
            f"outputs need unit stride over head_dim, got {q_out.stride()} and {k_out.stride()}"
        )
    if num_tokens == 0:
        return out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        q_out,
        k_out,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return out
