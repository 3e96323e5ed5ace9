"""Activation of a fused gate/up projection."""

from __future__ import annotations

import torch
from torch import nn

from nostall.kernels import ops


class SiluAndMul(nn.Module):
    """[..., 2 * I] holding [gate | up] -> silu(gate) * up: [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
