"""The attention layer models call: reshapes to heads and hands off to the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from nostall.layers.attention.metadata import AttentionContext


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Index of this layer's cache in ctx.kv_caches.
        self.layer_idx = layer_idx
        self.scale = scale
        # Keys visible to a query: itself and the sliding_window - 1 before it; None: all before it.
        self.sliding_window = sliding_window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """q: [T, H * D], k and v: [T, KVH * D] (new tokens, rotary applied) -> [T, H * D]."""
        num_tokens = q.shape[0]
        out = ctx.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            ctx.kv_caches[self.layer_idx],
            ctx.metadata,
            self.scale,
            self.sliding_window,
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"layer={self.layer_idx}, sliding_window={self.sliding_window}"
        )
