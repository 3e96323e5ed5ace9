"""Linear layers. Each delegates its weights and its matmul to a `LinearMethod`, so quantization plugs in."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nostall.errors import ModelLoadError
from nostall.layers.parameter import ShardId, copy_checked, new_parameter


class LinearMethod(abc.ABC):
    """Decides which tensors a linear layer holds, how they load, and how y = x W^T + b is computed."""

    @abc.abstractmethod
    def create_weights(self, layer: LinearBase) -> None:
        """Register the layer's parameters, each with a `weight_loader`."""

    @abc.abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] -> [T, out_features]."""


class UnquantizedLinearMethod(LinearMethod):
    """weight: [out_features, in_features] and optional bias: [out_features], in the model dtype."""

    def create_weights(self, layer: LinearBase) -> None:
        layer.weight = new_parameter(
            layer.out_features, layer.in_features, weight_loader=layer.weight_loader
        )
        bias = (
            new_parameter(layer.out_features, weight_loader=layer.weight_loader)
            if layer.has_bias
            else None
        )
        layer.register_parameter("bias", bias)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class LinearBase(nn.Module):
    """A linear layer whose output is the concatenation of `output_sizes` (one part unless fused)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    # The shard ids a checkpoint addresses the output parts with, in output order (empty: unfused).
    shard_ids: tuple[ShardId, ...] = ()

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.has_bias = bias
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        """Load a whole parameter (shard_id None) or one output part of a fused one (rows, dim 0)."""
        if shard_id is None:
            copy_checked(param.data, loaded)
            return
        if shard_id not in self.shard_ids:
            raise ModelLoadError(
                f"shard {shard_id!r} is unknown to {type(self).__name__}; accepted: {self.shard_ids}"
            )
        index = self.shard_ids.index(shard_id)
        offset = sum(self.output_sizes[:index])
        copy_checked(param.data.narrow(0, offset, self.output_sizes[index]), loaded)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.has_bias}"


class Linear(LinearBase):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, method: LinearMethod | None = None
    ) -> None:
        super().__init__(in_features, [out_features], bias, method)


class MergedLinear(LinearBase):
    """Several projections of the same input in one matmul (gate/up); shard ids 0..n-1."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__(in_features, output_sizes, bias, method)
        self.shard_ids = tuple(range(len(output_sizes)))


class QKVLinear(LinearBase):
    """Query, key and value projections in one matmul; output [q | k | v], shard ids "q", "k", "v"."""

    shard_ids = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        method: LinearMethod | None = None,
    ) -> None:
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias, method)
