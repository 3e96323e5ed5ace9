"""Attention backends: how one layer's attention runs over the paged KV cache."""

from __future__ import annotations

import abc
import importlib
from typing import ClassVar

import torch

from nostall.errors import ConfigError
from nostall.layers.attention.metadata import AttentionMetadata, KVCache


class AttentionBackend(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Write k, v [T, KVH, D] into kv_cache at metadata.slot_mapping, then attend with q [T, H, D]
        over each request's cached keys (causal, optionally windowed). Returns [T, H, D]."""


# Backend name -> "module:Class", imported on first use.
_BACKENDS: dict[str, str] = {
    "torch": "nostall.layers.attention.torch_backend:TorchAttentionBackend",
    "triton": "nostall.layers.attention.triton_backend:TritonAttentionBackend",
}


def get_attention_backend(name: str) -> AttentionBackend:
    target = _BACKENDS.get(name)
    if target is None:
        raise ConfigError(
            f"attention backend {name!r} is unknown; accepted: {', '.join(_BACKENDS)}"
        )
    module_name, class_name = target.split(":")
    backend_cls: type[AttentionBackend] = getattr(importlib.import_module(module_name), class_name)
    return backend_cls()
