"""Gated SiLU of a fused gate/up projection (twin of kernels/ref/activation.py).

Layout: x [N, 2 * I] holding [gate | up] with unit stride over the last dim; out [N, I].
Grid (N, cdiv(I, BLOCK)). silu(gate) is computed in float32 and rounded to x's dtype, then
multiplied by up and rounded again, as torch evaluates F.silu(gate) * up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(
        out_ptr + row * stride_out + cols,
        (silu.to(tl.float32) * up.to(tl.float32)).to(dtype),
        mask=mask,
    )


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2 * I] holding [gate | up]. Returns silu(gate) * up: [..., I] in x's dtype (written
    into out, a contiguous [..., I], when given)."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"last dim {x.shape[-1]} of x is odd; expected [gate | up] of equal sizes")
    intermediate = x.shape[-1] // 2
    if out is None:
        out = torch.empty(*x.shape[:-1], intermediate, dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_rows = out.view(-1, intermediate)
    if rows.shape[0] == 0:
        return out
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(intermediate, _BLOCK))](
        rows,
        out_rows,
        rows.stride(0),
        out_rows.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=_BLOCK,
    )
    return out
