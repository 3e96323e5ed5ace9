"""RMSNorm, computed exactly like transformers' LlamaRMSNorm: statistics in float32, scale in the input dtype."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D]; weight: [D]. Returns weight * normalized x, in x's dtype (when weight shares it)."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the pre-norm block's residual stream update."""
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps), new_residual
