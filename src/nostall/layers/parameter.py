"""Parameters that own their loading.

Every parameter carries `weight_loader(param, loaded, shard_id=None)`: model files hand each checkpoint
tensor to the loader of its destination, and fused or quantized layers decide there where it lands.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nostall.errors import ModelLoadError

# Names one part of a fused parameter: "q"/"k"/"v" for QKV projections, 0..n-1 for merged ones.
ShardId = str | int
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId | None], None]


def new_parameter(*shape: int, weight_loader: WeightLoader | None = None) -> nn.Parameter:
    """An uninitialized inference parameter in the default dtype on the default device."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = weight_loader or default_weight_loader  # type: ignore[attr-defined]
    return param


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    return getattr(param, "weight_loader", default_weight_loader)


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None
) -> None:
    if shard_id is not None:
        raise ModelLoadError(f"shard {shard_id!r} given for an unfused parameter; accepted: None")
    copy_checked(param.data, loaded)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a checkpoint tensor into (a slice of) a parameter, casting dtype and device."""
    if dst.shape != src.shape:
        raise ModelLoadError(
            f"checkpoint tensor has shape {tuple(src.shape)}; the parameter expects {tuple(dst.shape)}"
        )
    dst.copy_(src)
