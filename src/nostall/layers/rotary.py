"""Rotary position embedding with a precomputed cos/sin table.

The inverse frequencies and the attention scaling come from transformers (`ROPE_INIT_FUNCTIONS`), so
every rope type it knows (linear, llama3, yarn, ...) matches it exactly. Types whose frequencies depend
on the current sequence length cannot be tabulated once and are rejected.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nostall.errors import ConfigError
from nostall.kernels import ops

# Rope types whose inverse frequencies change with the sequence length seen at run time.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


class RotaryEmbedding(nn.Module):
    """Rotates [T, heads * head_dim] queries and keys; one instance is shared by all layers."""

    cos_sin_cache: torch.Tensor

    def __init__(
        self, head_dim: int, max_position: int, inv_freq: torch.Tensor, attention_scaling: float
    ) -> None:
        super().__init__()
        if 2 * inv_freq.numel() != head_dim:
            raise ConfigError(
                f"rotary dimension {2 * inv_freq.numel()} differs from head_dim={head_dim}; "
                "accepted: rotary embedding over the whole head"
            )
        self.head_dim = head_dim
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(positions.device, torch.float32)[None, :]
        # [max_position, head_dim] float32: [cos | sin], each over head_dim / 2 frequencies.
        cache = torch.cat(
            (freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1
        )
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        q, k = ops.apply_rotary(
            positions,
            q.view(num_tokens, -1, self.head_dim),
            k.view(num_tokens, -1, self.head_dim),
            self.cos_sin_cache,
        )
        return q.view(num_tokens, -1), k.view(num_tokens, -1)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope dict with "rope_type" and "rope_theta": transformers 5's `rope_parameters`, or the
    older `rope_scaling` plus `rope_theta`."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def get_rope(hf_config: Any, head_dim: int, max_position: int) -> RotaryEmbedding:
    """The rotary embedding transformers would build for this config, tabulated for max_position."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    accepted = ["default", *(t for t in ROPE_INIT_FUNCTIONS if t not in _LENGTH_DEPENDENT)]
    if rope_type not in accepted:
        reason = (
            "depends on the sequence length" if rope_type in _LENGTH_DEPENDENT else "is unknown"
        )
        raise ConfigError(f"rope_type={rope_type!r} {reason}; accepted: {', '.join(accepted)}")
    # The frequencies are computed on the host, as transformers computes them at model init.
    with torch.device("cpu"):
        if rope_type == "default":
            base = float(params["rope_theta"])
            exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
            inv_freq, attention_scaling = 1.0 / (base**exponents), 1.0
        else:
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return RotaryEmbedding(head_dim, max_position, inv_freq, float(attention_scaling))
