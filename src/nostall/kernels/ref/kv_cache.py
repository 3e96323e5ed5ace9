"""Scatter one step's keys and values into a paged KV cache."""

from __future__ import annotations

import torch


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, KVH, D]; key_cache, value_cache: [num_blocks, block_size, KVH, D], written in place;
    slot_mapping: [T] int, token t goes to flat slot block_id * block_size + offset; a negative slot
    skips the token (padding rows of CUDA-graph batches)."""
    kv_shape = key_cache.shape[2:]
    keep = slot_mapping >= 0
    key_cache.view(-1, *kv_shape)[slot_mapping[keep]] = k[keep].to(key_cache.dtype)
    value_cache.view(-1, *kv_shape)[slot_mapping[keep]] = v[keep].to(value_cache.dtype)
