"""The kernels layers call: the Triton twin for CUDA tensors (when triton is installed), the
pure-torch reference everywhere else. On the CPU the result is the reference's, bit for bit.

Triton modules are imported on the first CUDA call, so CPU-only runs never import triton.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from nostall.kernels.ref import activation as ref_activation
from nostall.kernels.ref import kv_cache as ref_kv_cache
from nostall.kernels.ref import rms_norm as ref_rms_norm
from nostall.kernels.ref import rotary as ref_rotary


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether the kernels for x run in Triton: x is on a CUDA device and triton is installed."""
    return x.is_cuda and triton_installed()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D]; weight: [D]. Returns weight * normalized x (see kernels/ref/rms_norm.py)."""
    if use_triton(x):
        from nostall.kernels.triton import rms_norm as triton_rms_norm

        return triton_rms_norm.rms_norm(x, weight, eps)
    return ref_rms_norm.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    if use_triton(x):
        from nostall.kernels.triton import rms_norm as triton_rms_norm

        return triton_rms_norm.fused_add_rms_norm(x, residual, weight, eps)
    return ref_rms_norm.fused_add_rms_norm(x, residual, weight, eps)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T]; q: [T, H, D]; k: [T, KVH, D]; cos_sin_cache: [max_position, D] float32
    [cos | sin]. Returns new rotated (q, k); the inputs are left unchanged."""
    if use_triton(q):
        from nostall.kernels.triton import rotary as triton_rotary

        return triton_rotary.rotary_embedding(positions, q, k, cos_sin_cache)
    return ref_rotary.rotary_embedding(positions, q, k, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding [gate | up]. Returns silu(gate) * up: [..., I]."""
    if use_triton(x):
        from nostall.kernels.triton import activation as triton_activation

        return triton_activation.silu_and_mul(x)
    return ref_activation.silu_and_mul(x)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k, v [T, KVH, D] into the paged caches at slot_mapping [T] (negative: skip)."""
    if use_triton(key_cache):
        from nostall.kernels.triton import kv_cache as triton_kv_cache

        triton_kv_cache.write_kv_cache(k, v, key_cache, value_cache, slot_mapping)
    else:
        ref_kv_cache.write_kv_cache(k, v, key_cache, value_cache, slot_mapping)
