"""Scatter one step's keys and values into a paged KV cache (twin of kernels/ref/kv_cache.py).

Layout: k, v [T, KVH, D] with unit stride over D; key_cache, value_cache
[num_blocks, block_size, KVH, D] with unit stride over D. Token t goes to flat slot
slot_mapping[t] = block_id * block_size + offset; a negative slot skips the token (padding rows of
CUDA-graph batches). One program per token writes all of its KVH * D elements; cache offsets are
int64 (num_blocks * block_size * KVH * D may exceed 2**31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    cache_offsets = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(key_cache_ptr + cache_offsets, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, KVH, D]; key_cache, value_cache: [num_blocks, block_size, KVH, D], written in place
    (same strides); slot_mapping: [T] int, flat slot per token, negative: skip the token."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(
            f"k and v need unit stride over head_dim, got {k.stride()} and {v.stride()}"
        )
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError(
            f"key and value caches need equal strides with unit stride over head_dim, got "
            f"{key_cache.stride()} and {value_cache.stride()}"
        )
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
