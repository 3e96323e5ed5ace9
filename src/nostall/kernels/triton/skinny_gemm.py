"""Skinny GEMM for decode: y = x @ weight^T (+ bias), few rows of x (twin of kernels/ref/skinny_gemm.py).

Layout: x [..., K] viewed as [M, K] rows with unit stride over K (any row stride); weight [N, K] with
unit stride over K (nn.Linear layout, any row stride); bias [N] or None; out [..., N] with unit stride
over N. Built for M in 1..16, where the step is bound by reading W once: each program owns BLOCK_N
output columns of BLOCK_M rows and streams its W rows in [BLOCK_N, BLOCK_K] tiles, 16-byte loads
along K, while the BLOCK_M rows of x (a few KB, served from L1/L2) are re-read beside each tile.
Numerics: products and sums in float32, bias added in float32, one rounding to out's dtype at the end.

Two ways to form the product, chosen by SkinnyConfig.dot:
- dot: tl.dot(W tile, x tile^T) with W as the left operand ("swap AB": BLOCK_N fills the MMA's tall
  side), M padded to BLOCK_M >= 16; float32 inputs use exact IEEE products (no TF32);
- sum: a [BLOCK_M, BLOCK_N, BLOCK_K] float32 accumulator of elementwise products, reduced over K
  once after the loop (no MMA, no per-tile shuffles), for M of 1 or 2.
Optional split-K: SPLIT_K programs per column block each sum a K slice into a float32 workspace
[SPLIT_K, M, N], and a second kernel adds the slices in a fixed order (deterministic, no atomics).
Rows past M or N are clamped onto valid rows for loading (loads carry no mask over M or N) and
never stored. No host syncs: the launch is graph-capturable.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    stride_osplit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
) -> None:
    """Grid (column blocks, K splits, row blocks). out_ptr is y [M, N] when there is one K split
    (bias added here), else the float32 workspace [SPLIT_K, M, N] (bias left to the reduce).
    k_per_split is a multiple of BLOCK_K; EVEN_K: every split's slice lies inside K (no K mask).
    NUM_STAGES tiles of W (and x) in flight through shared memory (cp.async); given to the loop
    explicitly, since the pipeliner otherwise only pipelines loads that feed a tl.dot."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # k_per_split is a multiple of BLOCK_K: tells the compiler the K offsets allow 16-byte loads.
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    # Clamped rows: every load is in bounds over M and N; only the store is masked.
    w_rows = (offs_n % N).to(tl.int64) * stride_wn
    x_rows = (offs_m % M).to(tl.int64) * stride_xm
    w_ptrs = w_ptr + w_rows[:, None] + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + x_rows[:, None] + (k_start + offs_k)[None, :]
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            k_mask = (k_start + k + offs_k) < K
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
        if DOT:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    # y: [BLOCK_M, BLOCK_N] float32.
    y = tl.trans(acc) if DOT else tl.sum(acc, axis=2)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_offs = offs_m[:, None] * stride_om + offs_n[None, :]
    if bias_ptr is not None:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        y += bias.to(tl.float32)[None, :]
    tl.store(out_ptr + pid_k * stride_osplit + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    N,
    stride_psplit,
    stride_pm,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """Grid (column blocks, M). out[m, n] = sum over s = 0..SPLIT_K-1, in that order, of
    partial[s, m, n] (+ bias[n]), rounded once to out's dtype."""
    m = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = partial_ptr + m * stride_pm + offs
    y = tl.load(row, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        y += tl.load(row + s * stride_psplit, mask=mask, other=0.0)
    if bias_ptr is not None:
        y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Tile choices of one launch. Block sizes are powers of 2; dot needs block_n, block_k >= 16."""

    block_n: int
    block_k: int
    split_k: int = 1
    dot: bool = False
    num_warps: int = 4
    num_stages: int = 4

    def block_m(self, m: int) -> int:
        """Rows of x per program: M rounded up to a power of 2, at least 16 for tl.dot; at most 64
        (dot) or 16 (sum), beyond which rows take more programs (grid axis 2)."""
        rows = triton.next_power_of_2(m)
        return min(64, max(16, rows)) if self.dot else min(16, rows)

    @property
    def name(self) -> str:
        mode = "dot" if self.dot else "sum"
        return (
            f"{mode}_n{self.block_n}_k{self.block_k}_s{self.split_k}"
            f"_w{self.num_warps}_st{self.num_stages}"
        )


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the CPU interpreter runs programs
    one by one, so the heuristic then keeps grids small)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(m: int, n: int, k: int, num_sms: int) -> SkinnyConfig:
    """Tiles for y[m, n] = x[m, k] @ W[n, k]^T on a device of num_sms SMs.

    M <= 2: sum mode, BLOCK_M * BLOCK_N * BLOCK_K = 8192 products per program-iteration (64 float32
    accumulators per thread at 4 warps). M >= 3: dot mode, [BLOCK_N, 128] tiles. BLOCK_N shrinks
    (to 8 in sum mode, 16 in dot mode) until there are >= 1.5 programs per SM; split-K (a power of
    2, >= 4 tiles of K per split) only when even then the column blocks cannot fill every SM once.
    To be replaced by the measured winners of benchmarks/bench_gemv.py."""
    dot = m > 2
    block_k = min(128 if dot else 256, max(16, triton.next_power_of_2(k)))
    if dot:
        block_n, min_block_n = 64, 16
    else:
        block_n, min_block_n = 8192 // (block_k * triton.next_power_of_2(m)), 8
    while block_n > min_block_n and triton.cdiv(n, block_n) * 2 < 3 * num_sms:
        block_n //= 2
    split_k = 1
    while triton.cdiv(n, block_n) * split_k < num_sms and k >= 2 * split_k * 4 * block_k:
        split_k *= 2
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, dot=dot)


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; bias: [N] or None. Returns x @ weight^T + bias: [..., N] in x's
    dtype (written into out, [..., N] with unit stride over N, when given). config: the tiles
    (default: default_config for this shape and device)."""
    num_cols, hidden = weight.shape
    if x.shape[-1] != hidden:
        raise ValueError(
            f"x has {x.shape[-1]} columns, weight {tuple(weight.shape)} expects {hidden}"
        )
    if bias is not None and bias.shape != (num_cols,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({num_cols},)")
    if out is None:
        out = torch.empty((*x.shape[:-1], num_cols), dtype=x.dtype, device=x.device)
    elif out.shape != (*x.shape[:-1], num_cols) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out is {out.dtype} {tuple(out.shape)} (stride {out.stride()}), expected {x.dtype} "
            f"{(*x.shape[:-1], num_cols)} with unit stride over the last dimension"
        )
    rows = x.reshape(-1, hidden)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out_rows = out.view(-1, num_cols)
    m = rows.shape[0]
    if m == 0 or num_cols == 0:
        return out
    if config is None:
        config = default_config(m, num_cols, hidden, num_sms(x.device))
    block_m = config.block_m(m)
    # Each split's slice of K: a whole number of BLOCK_K tiles.
    k_per_split = triton.cdiv(triton.cdiv(hidden, config.split_k), config.block_k) * config.block_k
    even_k = hidden == k_per_split * config.split_k
    grid = (triton.cdiv(num_cols, config.block_n), config.split_k, triton.cdiv(m, block_m))
    if config.split_k == 1:
        target, bias_here, stride_split = out_rows, bias, 0
    else:
        target = torch.empty((config.split_k, m, num_cols), dtype=torch.float32, device=x.device)
        bias_here, stride_split = None, target.stride(0)
    _skinny_gemm_kernel[grid](
        rows,
        weight,
        bias_here,
        target,
        m,
        num_cols,
        hidden,
        k_per_split,
        rows.stride(0),
        weight.stride(0),
        target.stride(-2),
        stride_split,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT=config.dot,
        EVEN_K=even_k,
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if config.split_k > 1:
        block = min(1024, triton.next_power_of_2(num_cols))
        _split_k_reduce_kernel[(triton.cdiv(num_cols, block), m)](
            target,
            bias,
            out_rows,
            num_cols,
            target.stride(0),
            target.stride(1),
            out_rows.stride(0),
            SPLIT_K=config.split_k,
            BLOCK=block,
            num_warps=4,
        )
    return out
