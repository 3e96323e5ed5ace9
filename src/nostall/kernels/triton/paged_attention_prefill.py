"""Variable-length causal attention over a paged KV cache: prefill, chunked prefill, mixed batches.

Layout (layers/attention/metadata.py): q [T, H, D] request-major, request r's queries are rows
query_start_loc[r]:query_start_loc[r + 1]; with q_len of them and seq_len = seq_lens[r] keys, query i
sits at position seq_len - q_len + i and sees keys j <= that position (and, with a sliding window W,
j > position - W). key_cache, value_cache [num_blocks, block_size, KVH, D]; block_tables
[R, max_blocks] int32; query_start_loc [R + 1] and seq_lens [R] int32 on the device.

Grid (cdiv(max_query_len, BLOCK_Q), R, KVH), flash-attention tiles: a program takes BLOCK_Q
consecutive queries of one request times all GROUP = H / KVH heads of one KV head, as BLOCK_M =
BLOCK_Q * GROUP (+ padding) rows, so K and V tiles (BLOCK_N keys, gathered through the block table)
are read once per group. Softmax is online, in float32, with QK^T and PV on tl.dot. A program only
visits the keys its queries can see, and exits at once when its queries lie past the request's q_len.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nostall.kernels.triton.attention_io import check_attention_io

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLIDING: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    q_block = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)

    query_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + req + 1) - query_start).to(tl.int32)
    first_query = q_block * BLOCK_Q
    if first_query >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    # Row m is query first_query + m // GROUP of head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    query_idx = first_query + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (query_idx < q_len)
    query_pos = context_len + query_idx
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_offsets = (query_start + query_idx)[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(
        q_ptr + q_offsets + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0
    )

    # Valid rows sit at positions [first_pos, last_pos]. Keys [lo, hi) cover all they can see;
    # keys [full_lo, full_hi) are visible to every one of them, so tiles inside skip the mask.
    first_pos = context_len + first_query
    last_pos = context_len + tl.minimum(first_query + BLOCK_Q, q_len) - 1
    hi = last_pos + 1
    full_hi = first_pos + 1
    lo = 0
    full_lo = 0
    if SLIDING:
        lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = last_pos - window + 1

    # Running max (log2 units, scale folded in), sum of exponentials, unnormalized output.
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    head_offset = kv_head * stride_cache_head
    for tile_start in range(lo, hi, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        in_range = pos < hi
        block_ids = tl.load(
            block_tables_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=in_range, other=0
        ).to(tl.int64)
        kv_rows = (
            block_ids * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot + head_offset
        )
        kv_mask = in_range[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if (tile_start < full_lo) | (tile_start + BLOCK_N > full_hi):
            visible = in_range[None, :] & (pos[None, :] <= query_pos[:, None])
            if SLIDING:
                visible = visible & (pos[None, :] > query_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
        # A row may see nothing in a tile (or at all, if it is padding): keep its exponents finite.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    # Every valid row sees at least its own position, so its denom > 0.
    result = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    o_offsets = (query_start + query_idx)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(
        out_ptr + o_offsets + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def _tile_config(head_dim: int, element_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) keeping Q plus pipelined K/V tiles in ~100 KiB of
    shared memory (Hopper has 227 KiB per SM)."""
    row_bytes = triton.next_power_of_2(head_dim) * element_size
    if row_bytes <= 256:
        return 128, 64, 8, 2
    return 64, 32, 4, 2


def paged_attention_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; key_cache, value_cache: [num_blocks, block_size, KVH, D]; query_start_loc:
    [R + 1] and seq_lens: [R] int32 (device); block_tables: [R, max_blocks]; max_query_len: a host
    bound on every request's q_len (sizes the grid). block_m, block_n: tile override (powers of two
    >= 16). out: [T, H, D] to write into. Returns out, in q's dtype unless out is given."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    q, out = check_attention_io(q, key_cache, value_cache, out)
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    default_m, default_n, num_warps, num_stages = _tile_config(head_dim, q.element_size())
    # At least one query per program: BLOCK_M rows hold BLOCK_Q whole groups of GROUP heads.
    block_m = max(block_m or default_m, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill_kernel[(triton.cdiv(max_query_len, block_q), num_reqs, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2E,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        SLIDING=sliding_window is not None,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n or default_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
