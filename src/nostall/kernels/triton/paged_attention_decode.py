"""Decode attention over a paged KV cache: one query token per request, split-KV (flash-decoding).

Layout: q [R, H, D] (row r is request r's only query, at position seq_lens[r] - 1); key_cache,
value_cache [num_blocks, block_size, KVH, D]; block_tables [R, max_blocks] int32; seq_lens [R]
int32 on the device (0 is allowed: a padding row, whose output is 0). H is a multiple of KVH.

Pass 1, grid (R, KVH, num_splits): a program takes all H / KVH query heads of one KV head (K and V
are read once per group) over one contiguous slice of the request's visible keys, gathered through
the block table, with an online softmax in float32. It writes the normalized partial output and its
log2-sum-exp (-inf for an empty slice). Slices are sized inside the kernel from seq_lens, so a
slice past a request's length simply does no work.
Pass 2, grid (R, H): combines the slices. With one split, pass 1 writes the output directly.

num_splits depends only on R (and the GPU), never on sequence lengths: every step of a captured
batch size launches the same grids, which keeps the call CUDA-graph capturable and sync-free.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nostall.kernels.triton.attention_io import check_attention_io

# Pass 1 aims for this many programs per SM; a request is never cut into more splits than this.
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
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
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLIDING: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(seq_lens_ptr + req)
    start = 0
    if SLIDING:
        start = tl.maximum(seq_len - window, 0)
    # Keys [start, seq_len) are visible; split s takes [lo, hi), a whole number of BLOCK_N tiles.
    chunk = tl.cdiv(tl.cdiv(seq_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    groups = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + groups
    dims = tl.arange(0, BLOCK_D)
    head_mask = groups < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + req * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    # Running max (log2 units, scale folded in), sum of exponentials, unnormalized output.
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    head_offset = kv_head * stride_cache_head
    for tile_start in range(lo, hi, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block_ids = tl.load(
            block_tables_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0
        ).to(tl.int64)
        rows = block_ids * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot + head_offset
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # Every tile holds a valid key (pos = tile_start < hi), so m_new is finite.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    # denom == 0 only for an empty slice (or an empty request); its output is 0 and its lse -inf.
    nonempty = denom > 0.0
    result = acc / tl.where(nonempty, denom, 1.0)[:, None]
    store_mask = head_mask[:, None] & dim_mask[None, :]
    if partial_out_ptr is None:
        tl.store(
            out_ptr + req * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # partial_out [R, H, num_splits, HEAD_DIM] and partial_lse [R, H, num_splits], contiguous.
        row = (req * NUM_HEADS + heads) * num_splits + split
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], result, mask=store_mask)
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, denom, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + row, lse, mask=head_mask)


@triton.jit
def _decode_reduce_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    row = (req * NUM_HEADS + head) * num_splits + splits
    lse = tl.load(partial_lse_ptr + row, mask=splits < num_splits, other=float("-inf"))
    nonempty = lse > float("-inf")
    lse_max = tl.max(lse, axis=0)
    # All slices empty (seq_len 0): every weight is 0 and so is the output.
    weights = tl.where(
        nonempty, tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0)), 0.0
    )
    partial = tl.load(
        partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=nonempty[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.sum(weights, axis=0)
    result = tl.sum(weights[:, None] * partial, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + req * stride_ot + head * stride_oh + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the CPU interpreter)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def default_num_splits(num_reqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per request so that pass 1 fills ~_PROGRAMS_PER_SM programs per SM: 1.._MAX_SPLITS.
    A function of the batch shape only, so every step of a captured batch size agrees."""
    wanted = _PROGRAMS_PER_SM * _num_sms(device)
    return max(1, min(_MAX_SPLITS, triton.cdiv(wanted, max(1, num_reqs * num_kv_heads))))


def paged_attention_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [R, H, D], one query per request at its last position; key_cache, value_cache:
    [num_blocks, block_size, KVH, D]; seq_lens: [R] int32 (device); block_tables: [R, max_blocks].
    Keys j < seq_len are visible, and with a sliding window W only j >= seq_len - W.
    num_splits: KV slices per request (None: default_num_splits). out: [R, H, D] to write into.
    Returns out, in q's dtype unless out is given."""
    num_reqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if seq_lens.shape[0] != num_reqs:
        raise ValueError(
            f"decode takes one query per request: q has {num_reqs} rows, seq_lens "
            f"{seq_lens.shape[0]} entries"
        )
    q, out = check_attention_io(q, key_cache, value_cache, out)
    if num_reqs == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_reqs, num_kv_heads, q.device)
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    # One K and one V tile of at most 16 KiB each (fits the pipeline's shared memory on Hopper).
    block_n = 64 if block_d * q.element_size() <= 256 else 32
    partial_out: torch.Tensor | None = None
    partial_lse: torch.Tensor | None = None
    if num_splits > 1:
        partial_out = torch.empty(
            num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            num_reqs, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
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
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        SLIDING=sliding_window is not None,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, block_d),
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    if partial_out is not None:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            partial_out,
            partial_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
