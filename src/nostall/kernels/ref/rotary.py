"""Neox-style rotary embedding (rotate the two halves of each head), as transformers' Llama applies it."""

from __future__ import annotations

import torch


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by their token's position.

    positions: [T] int; q: [T, H, D]; k: [T, KVH, D]; cos_sin_cache: [max_position, D] float32 holding
    [cos | sin] of position * inv_freq (D / 2 frequencies each, attention scaling already applied).
    cos and sin are cast to q's dtype before use, as transformers does. Returns new (q, k).
    """
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype).unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
