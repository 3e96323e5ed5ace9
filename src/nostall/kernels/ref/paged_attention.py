"""Causal attention of a flat batch of queries over a paged KV cache (layout in layers/attention/metadata.py)."""

from __future__ import annotations

import torch


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; key_cache, value_cache: [num_blocks, block_size, KVH, D] with H a multiple of KVH;
    query_start_loc: [R + 1] and seq_lens: [R] (host tensors); block_tables: [R, max_blocks].

    Query i of a request with q_len queries and seq_len keys sits at position p = seq_len - q_len + i
    and sees keys j with j <= p and, with a sliding window W, j > p - W (W keys including itself, as
    transformers masks). Computes in float32 and returns [T, H, D] in q's dtype.
    """
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[r], starts[r + 1]
        q_len = end - start
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[r, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)

        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window

        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
