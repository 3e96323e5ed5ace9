"""Routing checkpoint tensors to model parameters, through fused modules, by parameter-owned loaders."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from nostall.errors import ModelLoadError
from nostall.layers.parameter import ShardId, get_weight_loader

# Fused module -> the checkpoint modules it is loaded from, each with its shard id.
PackedModules = dict[str, tuple[tuple[str, ShardId], ...]]


def route(name: str, packed_modules: PackedModules) -> tuple[str, ShardId | None]:
    """Checkpoint tensor name -> (parameter name, shard id); names outside fused modules map to themselves."""
    for fused, parts in packed_modules.items():
        for part, shard_id in parts:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def checkpoint_names(model: nn.Module, packed_modules: PackedModules) -> list[str]:
    """The standard checkpoint tensor names the model loads from (fused parameters expanded)."""
    names = []
    for param_name, _ in model.named_parameters():
        module_path, _, leaf = param_name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        parts = packed_modules.get(module)
        if parts is None:
            names.append(param_name)
        else:
            names.extend(f"{parent}.{part}.{leaf}" for part, _ in parts)
    return names


def load_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], packed_modules: PackedModules
) -> set[str]:
    """Hand each checkpoint tensor to its parameter's weight_loader; tensors with no destination
    (rotary inv_freq, an lm_head tied to the embedding) are skipped. Returns the names of the
    parameters now fully loaded: every shard of a fused parameter, or the whole of it at once."""
    params = dict(model.named_parameters())
    loaded: dict[str, set[ShardId | None]] = {}
    for name, tensor in weights:
        param_name, shard_id = route(name, packed_modules)
        param = params.get(param_name)
        if param is None:
            continue
        try:
            get_weight_loader(param)(param, tensor, shard_id)
        except ModelLoadError as e:
            raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
        loaded.setdefault(param_name, set()).add(shard_id)

    def complete(param_name: str, shards: set[ShardId | None]) -> bool:
        module = param_name.rpartition(".")[0].rpartition(".")[2]
        expected: set[ShardId | None] = {shard_id for _, shard_id in packed_modules.get(module, ())}
        return None in shards or expected <= shards

    return {name for name, shards in loaded.items() if complete(name, shards)}
