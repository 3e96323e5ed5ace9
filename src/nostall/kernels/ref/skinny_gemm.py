"""Linear layer of a decode step: y = x @ weight^T (+ bias), in float32 math."""

from __future__ import annotations

import torch


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [..., K]; weight: [N, K] (nn.Linear layout); bias: [N] or None. Returns [..., N] in x's
    dtype: the product and the bias summed in float32, rounded once at the end."""
    y = x.to(torch.float32) @ weight.to(torch.float32).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
