"""Architecture name (config.json "architectures") -> model class, imported on first use."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import ClassVar, Protocol

import torch

from nostall.config import ModelConfig
from nostall.errors import ModelLoadError
from nostall.layers.attention.metadata import AttentionContext
from nostall.layers.parameter import ShardId


class CausalLM(Protocol):
    """What the loader and the model runner rely on; models are also `nn.Module`s."""

    # Fused module -> the checkpoint modules it is loaded from, each with its shard id.
    packed_modules: ClassVar[dict[str, tuple[tuple[str, ShardId], ...]]]

    def __init__(self, config: ModelConfig) -> None: ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor: ...

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """[T] token ids and positions -> [T, hidden_size] final hidden states."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 [N, vocab_size]."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (checkpoint name, tensor) pairs; returns the names of the fully loaded parameters."""
        ...


_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "nostall.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "nostall.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "nostall.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "nostall.models.qwen3:Qwen3ForCausalLM",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def get_model_class(architecture: str) -> type[CausalLM]:
    target = _MODELS.get(architecture)
    if target is None:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; accepted: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module_name, class_name = target.split(":")
    model_cls: type[CausalLM] = getattr(importlib.import_module(module_name), class_name)
    return model_cls
