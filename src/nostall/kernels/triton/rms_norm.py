"""RMSNorm and fused residual-add + RMSNorm (twins of kernels/ref/rms_norm.py).

Layout: x (and residual) [N, D] with unit stride over D, any row stride; weight [D]. One program per
row. Numerics follow transformers' LlamaRMSNorm: the sum is formed in the input dtype, the statistics
in float32, the normalized row is rounded to the input dtype and then multiplied by the weight in the
promoted dtype of the two (exact in float32 before the final rounding, as torch computes it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    HIDDEN: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if residual_ptr is not None:
        # residual + x, rounded to the residual stream's dtype; this sum is what gets normalized.
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / HIDDEN
    normed = (h / tl.sqrt_rn(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [N, D] with unit stride over D (a view when the strides allow it)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    x_rows = _as_rows(x)
    residual_rows = None if residual is None else _as_rows(residual)
    out_rows = out.view(-1, hidden)
    residual_out_rows = None if residual_out is None else residual_out.view(-1, hidden)
    if x_rows.shape[0] == 0:
        return
    block_d = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows,
        residual_rows,
        weight.contiguous(),
        out_rows,
        residual_out_rows,
        eps,
        x_rows.stride(0),
        0 if residual_rows is None else residual_rows.stride(0),
        out_rows.stride(0),
        0 if residual_out_rows is None else residual_out_rows.stride(0),
        HIDDEN=hidden,
        BLOCK_D=block_d,
        num_warps=max(1, min(16, block_d // 256)),
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [..., D]; weight: [D]. Returns weight * normalized x in the promoted dtype of the two
    (written into out, a contiguous [..., D], when given)."""
    if out is None:
        out = torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
        )
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D]; weight: [D]. Returns (rms_norm(x + residual), x + residual), written
    into out (two contiguous [..., D]) when given; out may alias (x, residual) for an in-place update."""
    if out is None:
        new_residual = torch.empty(
            x.shape, dtype=torch.promote_types(residual.dtype, x.dtype), device=x.device
        )
        normed = torch.empty(
            x.shape, dtype=torch.promote_types(new_residual.dtype, weight.dtype), device=x.device
        )
        out = (normed, new_residual)
    _launch(x, residual, weight, eps, out[0], out[1])
    return out
