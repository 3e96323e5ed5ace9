"""The Triton kernels against their pure-torch twins in kernels/ref, on fresh random inputs.

Every test runs two ways:
- "interp-*": CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, which conftest.py sets
  when no GPU is present), small sizes, float32 and float16 (the interpreter garbles bfloat16);
- "cuda-*": marked gpu (run with `pytest -m gpu`), realistic sizes, float32, float16 and bfloat16.
Errors are measured as ||out - ref|| / ||ref|| and bounded per dtype (TOLERANCE). Outputs are
poisoned with NaN before a kernel runs and caches start as NaN, so an element a kernel fails to write,
or a slot it reads without cause, fails the test.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import build_metadata, random_block_tables

pytest.importorskip("triton")

from nostall.kernels import ops
from nostall.kernels.ref import activation as ref_activation
from nostall.kernels.ref import kv_cache as ref_kv_cache
from nostall.kernels.ref import rms_norm as ref_rms_norm
from nostall.kernels.ref import rotary as ref_rotary
from nostall.kernels.ref import skinny_gemm as ref_skinny_gemm
from nostall.kernels.ref.paged_attention import paged_attention
from nostall.kernels.triton.activation import silu_and_mul
from nostall.kernels.triton.kv_cache import write_kv_cache
from nostall.kernels.triton.paged_attention_decode import paged_attention_decode
from nostall.kernels.triton.paged_attention_prefill import paged_attention_prefill
from nostall.kernels.triton.rms_norm import fused_add_rms_norm, rms_norm
from nostall.kernels.triton.rotary import rotary_embedding
from nostall.kernels.triton.skinny_gemm import SkinnyConfig, skinny_gemm
from nostall.layers.attention.backend import get_attention_backend
from nostall.layers.attention.metadata import AttentionMetadata, KVCache
from nostall.layers.rotary import RotaryEmbedding

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()

# Bound on ||out - ref|| / ||ref||: about 4x the output rounding of each dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as numpy arrays of shape (1,) and turns them into
    Python ints (as `range` bounds computed inside a kernel) with int(array), which numpy >= 2.4
    rejects: "only 0-dimensional arrays can be converted to Python scalars". Convert via .item()."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return

    def patched(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _patch_interpreter_scalar_index()


@dataclasses.dataclass(frozen=True)
class Target:
    device: str
    dtype: torch.dtype

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def id(self) -> str:
        return f"{'cuda' if self.gpu else 'interp'}-{str(self.dtype).removeprefix('torch.')}"


_INTERP_MARKS = [
    pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1 (no GPU present)")
]
_GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
TARGETS = [
    Target("cpu", torch.float32),
    Target("cpu", torch.float16),
    Target("cuda", torch.float32),
    Target("cuda", torch.float16),
    Target("cuda", torch.bfloat16),
]


def _params(cases: Callable[[Target], list[Any]]) -> list[Any]:
    """pytest params (target, case) for every target and each of its cases, marked per target."""
    return [
        pytest.param(
            target,
            case,
            id=f"{target.id}-{getattr(case, 'name', case)}",
            marks=_GPU_MARKS if target.gpu else _INTERP_MARKS,
        )
        for target in TARGETS
        for case in cases(target)
    ]


def _generator(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(
    shape: tuple[int, ...], target: Target, generator: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=generator)).to(target.device, target.dtype)


def _poison(shape: tuple[int, ...], target: Target) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=target.dtype, device=target.device)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum()} non-finite elements"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]} for {dtype}"


# ----------------------------------------------------------------------------------------------
# Paged attention


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    name: str
    # (cached prefix length, new tokens) per request.
    reqs: tuple[tuple[int, int], ...]
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    window: int | None = None
    # Decode: KV slices per request (None: the kernel's default for the batch size).
    num_splits: int | None = None
    # Prefill: (block_m, block_n) tile override (None: the kernel's default tiles).
    tiles: tuple[int, int] | None = None
    # Standard deviation of q; large values make logits of hundreds (a nearly one-hot softmax).
    q_scale: float = 2.0


def _decode_reqs(lengths: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple((n - 1, 1) for n in lengths)


def _random_lengths(count: int, high: int, seed: int, ones: int) -> list[int]:
    """count lengths in [1, high], the first `ones` of them 1."""
    lengths = torch.randint(1, high + 1, (count,), generator=torch.Generator().manual_seed(seed))
    return [1] * ones + lengths.tolist()[ones:]


def _decode_cases(target: Target) -> list[AttentionCase]:
    if not target.gpu:
        short = _decode_reqs([1, 37, 5, 1, 64, 20])
        return [
            AttentionCase("b1_long_gqa4", _decode_reqs([300]), 8, 2, 32, 16, num_splits=5),
            AttentionCase("b1_long_tiles_one_split", _decode_reqs([300]), 8, 2, 32, 16, num_splits=1),
            AttentionCase("b2_peaked_logits", _decode_reqs([290, 200]), 4, 2, 32, 32, num_splits=2, q_scale=40.0),
            AttentionCase("b1_long_splits_past_end", _decode_reqs([40]), 4, 4, 16, 32, num_splits=7),
            AttentionCase("short_mha", short, 4, 4, 16, 16),
            AttentionCase("short_gqa4_split", short, 8, 2, 32, 32, num_splits=3),
            AttentionCase("short_gqa8_window", short, 8, 1, 16, 16, window=9, num_splits=2),
            AttentionCase("long_gqa3_window", _decode_reqs([150, 2]), 6, 2, 16, 16, window=40, num_splits=4),
        ]  # fmt: skip
    many_short = _decode_reqs(_random_lengths(256, 1024, 0, ones=5))
    return [
        AttentionCase("b1_8k_gqa4", _decode_reqs([8192]), 32, 8, 128, 16),
        AttentionCase("b1_8k_gqa4_64splits", _decode_reqs([8191]), 32, 8, 128, 32, num_splits=64),
        AttentionCase("b256_short_gqa4", many_short, 32, 8, 128, 32),
        AttentionCase("b64_mha_d64", _decode_reqs(_random_lengths(64, 2000, 1, 3)), 32, 32, 64, 16),
        AttentionCase("b16_gqa8_window", _decode_reqs(_random_lengths(16, 4000, 2, 2)), 64, 8, 128, 32, window=1024),
        AttentionCase("b8_gqa7_d64", _decode_reqs(_random_lengths(8, 3000, 3, 1)), 28, 4, 64, 16, num_splits=9),
        AttentionCase("b1_window_4k", _decode_reqs([5000]), 32, 8, 128, 16, window=4096),
        AttentionCase("b4_d256", _decode_reqs([1, 900, 3000, 64]), 16, 2, 256, 16),
        AttentionCase("b32_peaked_logits", _decode_reqs(_random_lengths(32, 2000, 6, 1)), 32, 8, 128, 16, q_scale=20.0),
    ]  # fmt: skip


def _prefill_cases(target: Target) -> list[AttentionCase]:
    if not target.gpu:
        return [
            AttentionCase("prefill_gqa4", ((0, 37), (0, 1), (0, 20)), 8, 2, 32, 16, tiles=(16, 16)),
            AttentionCase("chunked_mha", ((17, 9), (40, 16), (3, 30)), 4, 4, 16, 32, tiles=(32, 16)),
            AttentionCase("mixed_gqa8", ((0, 25), (30, 1), (9, 4), (12, 1)), 8, 1, 16, 16, tiles=(16, 32)),
            AttentionCase("chunked_gqa3_window", ((20, 14), (0, 33), (50, 1)), 6, 2, 16, 16, window=10, tiles=(16, 16)),
            AttentionCase("mixed_default_tiles", ((0, 70), (5, 1), (30, 3)), 4, 2, 32, 16, window=33),
            AttentionCase("chunked_peaked_logits", ((20, 40), (50, 2)), 4, 2, 32, 16, tiles=(16, 16), q_scale=40.0),
            # 64 queries per program, a window of 10: late rows see no key of the first tiles.
            AttentionCase("prefill_mha_window_wide_rows", ((0, 100), (7, 60)), 2, 2, 16, 16, window=10, tiles=(64, 16)),
            # BLOCK_Q = 2: some tiles start exactly at the window's edge for the last row.
            AttentionCase("chunked_gqa8_window_edges", ((40, 30), (0, 50)), 8, 1, 16, 16, window=20, tiles=(16, 16)),
        ]  # fmt: skip
    decodes = tuple((n - 1, 1) for n in _random_lengths(40, 3000, 4, ones=2))
    verify = tuple((n, 5) for n in _random_lengths(16, 2000, 5, ones=1))
    return [
        AttentionCase("prefill_3000_gqa4", ((0, 3000),), 32, 8, 128, 16),
        AttentionCase("prefill_batch_gqa4", ((0, 500), (0, 1), (0, 1000), (0, 77)), 32, 8, 128, 32),
        AttentionCase("chunked_gqa4", ((2000, 512), (100, 300), (4000, 1)), 32, 8, 128, 16),
        AttentionCase("mixed_decodes_mha_d64", ((0, 700), (1500, 256), *decodes), 32, 32, 64, 16),
        AttentionCase("mixed_gqa8_window", ((0, 1200), (3000, 100), *decodes), 64, 8, 128, 32, window=256),
        AttentionCase("verify_gqa7_d64", verify, 28, 4, 64, 16),
        AttentionCase("chunked_d256", ((0, 300), (700, 200)), 16, 2, 256, 16),
        AttentionCase("prefill_mha_window_d64", ((0, 2000), (500, 700)), 32, 32, 64, 16, window=100),
        AttentionCase("chunked_peaked_logits", ((1000, 300), (0, 500)), 32, 8, 128, 16, q_scale=20.0),
    ]  # fmt: skip


@dataclasses.dataclass
class PagedInputs:
    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def _paged_inputs(case: AttentionCase, target: Target) -> PagedInputs:
    """Caches (NaN where unwritten) holding every request's keys, and the step's queries."""
    generator = _generator(case, target.id)
    seq_lens = [c + n for c, n in case.reqs]
    num_blocks = sum(-(-n // case.block_size) for n in seq_lens) + 7
    tables = random_block_tables(seq_lens, case.block_size, num_blocks, generator)
    shape = (num_blocks, case.block_size, case.kv_heads, case.head_dim)
    key_cache, value_cache = _poison(shape, target), _poison(shape, target)
    kv_shape = (sum(seq_lens), case.kv_heads, case.head_dim)
    all_tokens = build_metadata(seq_lens, seq_lens, tables, case.block_size, target.device)
    ref_kv_cache.write_kv_cache(
        _randn(kv_shape, target, generator),
        _randn(kv_shape, target, generator),
        key_cache,
        value_cache,
        all_tokens.slot_mapping,
    )
    meta = build_metadata(
        [n for _, n in case.reqs], seq_lens, tables, case.block_size, target.device
    )
    q = _randn((meta.num_tokens, case.heads, case.head_dim), target, generator, case.q_scale)
    return PagedInputs(q, key_cache, value_cache, meta, case.head_dim**-0.5)


def _reference(inputs: PagedInputs, window: int | None) -> torch.Tensor:
    return paged_attention(
        inputs.q,
        inputs.key_cache,
        inputs.value_cache,
        inputs.meta.query_start_loc_cpu,
        inputs.meta.seq_lens_cpu,
        inputs.meta.block_tables,
        inputs.scale,
        window,
    )


@pytest.mark.parametrize(("target", "case"), _params(_decode_cases))
def test_decode_matches_ref(target: Target, case: AttentionCase) -> None:
    inputs = _paged_inputs(case, target)
    out = paged_attention_decode(
        inputs.q,
        inputs.key_cache,
        inputs.value_cache,
        inputs.meta.seq_lens,
        inputs.meta.block_tables,
        inputs.scale,
        case.window,
        num_splits=case.num_splits,
        out=_poison(tuple(inputs.q.shape), target),
    )
    _assert_close(out, _reference(inputs, case.window), target.dtype)


@pytest.mark.parametrize(("target", "case"), _params(_prefill_cases))
def test_prefill_matches_ref(target: Target, case: AttentionCase) -> None:
    inputs = _paged_inputs(case, target)
    block_m, block_n = case.tiles or (None, None)
    out = paged_attention_prefill(
        inputs.q,
        inputs.key_cache,
        inputs.value_cache,
        inputs.meta.query_start_loc,
        inputs.meta.seq_lens,
        inputs.meta.block_tables,
        inputs.meta.max_query_len,
        inputs.scale,
        case.window,
        block_m=block_m,
        block_n=block_n,
        out=_poison(tuple(inputs.q.shape), target),
    )
    _assert_close(out, _reference(inputs, case.window), target.dtype)


def _backend_cases(target: Target) -> list[str]:
    return ["gqa", "window"]


def _pad_decode_batch(meta: AttentionMetadata, num_padding: int) -> AttentionMetadata:
    """The batch plus `num_padding` rows as a CUDA-graph runner pads it: no keys (seq_len 0), block
    table row 0, KV slot -1 (skipped)."""
    pad = torch.zeros(num_padding, dtype=torch.int32)
    device = meta.seq_lens.device
    seq_lens_cpu = torch.cat([meta.seq_lens_cpu, pad])
    query_start_cpu = torch.arange(seq_lens_cpu.shape[0] + 1, dtype=torch.int32)
    padded_tables = torch.zeros(num_padding, meta.block_tables.shape[1], dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=query_start_cpu.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_tables=torch.cat([meta.block_tables, padded_tables.to(device)]),
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((num_padding,), -1, device=device)]),
        query_start_loc_cpu=query_start_cpu,
        seq_lens_cpu=seq_lens_cpu,
        max_query_len=1,
        max_seq_len=meta.max_seq_len,
    )


@pytest.mark.parametrize(("target", "variant"), _params(_backend_cases))
def test_triton_backend_matches_torch_backend(target: Target, variant: str) -> None:
    """A prefill step (with a cached prefix), then a decode step padded like a CUDA-graph batch,
    through both backends on twin caches."""
    heads, kv_heads, head_dim, block_size = (8, 2, 32, 16) if not target.gpu else (32, 8, 128, 16)
    window = None if variant == "gqa" else 24
    scale = head_dim**-0.5
    generator = _generator(variant, target.id)
    prompt_lens = [30, 1, 45] if not target.gpu else [1000, 1, 3000]
    # Request 0 has a cached prefix of 9 tokens; every request then decodes one token.
    cached = [9, 0, 0]
    num_blocks = sum(-(-(n + 1) // block_size) for n in prompt_lens) + 7
    tables = random_block_tables([n + 1 for n in prompt_lens], block_size, num_blocks, generator)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    triton_cache = KVCache(_poison(shape, target), _poison(shape, target))
    torch_cache = KVCache(_poison(shape, target), _poison(shape, target))
    triton_backend = get_attention_backend("triton")
    torch_backend = get_attention_backend("torch")

    def step(meta: AttentionMetadata) -> None:
        num_tokens = meta.num_tokens
        q = _randn((num_tokens, heads, head_dim), target, generator)
        k = _randn((num_tokens, kv_heads, head_dim), target, generator)
        v = _randn((num_tokens, kv_heads, head_dim), target, generator)
        out = triton_backend.forward(q, k, v, triton_cache, meta, scale, window)
        ref = torch_backend.forward(q, k, v, torch_cache, meta, scale, window)
        _assert_close(out, ref, target.dtype)
        torch.testing.assert_close(
            triton_cache.key, torch_cache.key, rtol=0, atol=0, equal_nan=True
        )
        torch.testing.assert_close(
            triton_cache.value, torch_cache.value, rtol=0, atol=0, equal_nan=True
        )

    # The prefixes were written by an earlier step (request 0 only).
    step(build_metadata([cached[0]], [cached[0]], tables[:1], block_size, target.device))
    step(
        build_metadata(
            [n - c for n, c in zip(prompt_lens, cached, strict=True)],
            prompt_lens,
            tables,
            block_size,
            target.device,
        )
    )
    decode = build_metadata(
        [1] * 3, [n + 1 for n in prompt_lens], tables, block_size, target.device
    )
    step(_pad_decode_batch(decode, 2))


# ----------------------------------------------------------------------------------------------
# KV cache write


def _kv_cases(target: Target) -> list[str]:
    return ["write"]


@pytest.mark.parametrize(("target", "case"), _params(_kv_cases))
def test_write_kv_cache_matches_ref_and_skips_negative_slots(target: Target, case: str) -> None:
    num_blocks, block_size, kv_heads, head_dim = (
        (6, 16, 2, 24) if not target.gpu else (4000, 16, 8, 128)
    )
    num_tokens = 37 if not target.gpu else 3000
    generator = _generator(case, target.id)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = _poison(shape, target)
    value_cache = _randn(shape, target, generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=generator)[: num_tokens // 4]] = -1
    slots = slots.to(target.device)
    # k and v as views into a fused [T, (H + 2 KVH) * D] projection, as models produce them.
    qkv = _randn((num_tokens, (4 * kv_heads) * head_dim), target, generator)
    k = qkv[:, 2 * kv_heads * head_dim : 3 * kv_heads * head_dim].view(
        num_tokens, kv_heads, head_dim
    )
    v = qkv[:, 3 * kv_heads * head_dim :].view(num_tokens, kv_heads, head_dim)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    ref_kv_cache.write_kv_cache(k, v, expected_key, expected_value, slots)
    write_kv_cache(k, v, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache, expected_key, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, expected_value, rtol=0, atol=0, equal_nan=True)


def test_ref_write_kv_cache_skips_negative_slots() -> None:
    generator = torch.Generator().manual_seed(6)
    key_cache = torch.randn(3, 4, 2, 5, generator=generator)
    value_cache = torch.randn(3, 4, 2, 5, generator=generator)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    slots = torch.tensor([5, -1, 11, -1])
    k = torch.randn(4, 2, 5, generator=generator)
    v = torch.randn(4, 2, 5, generator=generator)
    ref_kv_cache.write_kv_cache(k, v, key_cache, value_cache, slots)
    before_k.view(12, 2, 5)[[5, 11]] = k[[0, 2]]
    before_v.view(12, 2, 5)[[5, 11]] = v[[0, 2]]
    assert torch.equal(key_cache, before_k)
    assert torch.equal(value_cache, before_v)


# ----------------------------------------------------------------------------------------------
# RMSNorm, rotary, SiLU


def _norm_cases(target: Target) -> list[str]:
    return ["rows", "qk_norm_view"] + (["wide"] if target.gpu else [])


def _norm_input(case: str, target: Target, generator: torch.Generator) -> torch.Tensor:
    """rows: [T, hidden]; qk_norm_view: [T, H, D] heads viewed out of a fused projection."""
    if case == "qk_norm_view":
        tokens, heads, head_dim = (5, 3, 48) if not target.gpu else (300, 32, 128)
        fused = _randn((tokens, (heads + 2) * head_dim), target, generator, scale=3.0)
        return fused[:, : heads * head_dim].view(tokens, heads, head_dim)
    tokens, hidden = {"rows": (7, 64), "wide": (257, 8192)}[case]
    if target.gpu and case == "rows":
        tokens, hidden = 513, 576
    return _randn((tokens, hidden), target, generator, scale=3.0)


@pytest.mark.parametrize(("target", "case"), _params(_norm_cases))
def test_rms_norm_matches_ref(target: Target, case: str) -> None:
    generator = _generator(case, target.id)
    x = _norm_input(case, target, generator)
    weight = 1 + _randn((x.shape[-1],), target, generator, scale=0.3)
    out = rms_norm(x, weight, 1e-5, out=_poison(tuple(x.shape), target))
    _assert_close(out, ref_rms_norm.rms_norm(x, weight, 1e-5), target.dtype)


@pytest.mark.parametrize(("target", "case"), _params(_norm_cases))
def test_fused_add_rms_norm_matches_ref(target: Target, case: str) -> None:
    generator = _generator(case, target.id)
    x = _norm_input(case, target, generator)
    residual = _randn(tuple(x.shape), target, generator)
    weight = 1 + _randn((x.shape[-1],), target, generator, scale=0.3)
    expected, expected_residual = ref_rms_norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    poisoned = (_poison(tuple(x.shape), target), _poison(tuple(x.shape), target))
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5, out=poisoned)
    _assert_close(out, expected, target.dtype)
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    # In place: the normalized rows replace x, the sum replaces residual.
    x, residual = x.contiguous(), residual.clone()
    fused_add_rms_norm(x, residual, weight, 1e-5, out=(x, residual))
    _assert_close(x, expected, target.dtype)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)


def _rotary_cases(target: Target) -> list[str]:
    return ["gqa", "mha_odd_heads"]


@pytest.mark.parametrize(("target", "case"), _params(_rotary_cases))
def test_rotary_matches_ref(target: Target, case: str) -> None:
    generator = _generator(case, target.id)
    heads, kv_heads = (8, 2) if case == "gqa" else (3, 3)
    tokens, head_dim, max_position = (9, 32, 64) if not target.gpu else (1000, 128, 8192)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    rope = RotaryEmbedding(head_dim, max_position, inv_freq, 1.0).to(target.device)
    positions = torch.randint(0, max_position, (tokens,), generator=generator).to(target.device)
    # q and k as views into a fused projection: token stride (heads + 2 * kv_heads) * head_dim.
    qkv = _randn((tokens, (heads + 2 * kv_heads) * head_dim), target, generator)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    expected_q, expected_k = ref_rotary.rotary_embedding(positions, q, k, rope.cos_sin_cache)
    poisoned = (_poison(tuple(q.shape), target), _poison(tuple(k.shape), target))
    q_out, k_out = rotary_embedding(positions, q, k, rope.cos_sin_cache, out=poisoned)
    _assert_close(q_out, expected_q, target.dtype)
    _assert_close(k_out, expected_k, target.dtype)
    # In place, inside the fused tensor: v's columns stay as they were.
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    rotary_embedding(positions, q, k, rope.cos_sin_cache, out=(q, k))
    _assert_close(q, expected_q, target.dtype)
    _assert_close(k, expected_k, target.dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


def _silu_cases(target: Target) -> list[str]:
    return ["small", "3d"] + (["wide"] if target.gpu else [])


@pytest.mark.parametrize(("target", "case"), _params(_silu_cases))
def test_silu_and_mul_matches_ref(target: Target, case: str) -> None:
    generator = _generator(case, target.id)
    shape = {"small": (5, 2 * 24), "3d": (2, 3, 2 * 1100), "wide": (300, 2 * 11008)}[case]
    x = _randn(shape, target, generator, scale=3.0)
    out = silu_and_mul(x, out=_poison((*shape[:-1], shape[-1] // 2), target))
    _assert_close(out, ref_activation.silu_and_mul(x), target.dtype)


# ----------------------------------------------------------------------------------------------
# Skinny GEMM (decode linear layers)


@dataclasses.dataclass(frozen=True)
class GemmCase:
    name: str
    m: int
    n: int
    k: int
    bias: bool
    # None: the kernel's default tiles for the shape.
    config: SkinnyConfig | None = None


# Llama-3.1-8B's projections (N, K).
_LLAMA_8B_LINEARS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def _gemm_cases(target: Target) -> list[GemmCase]:
    if not target.gpu:
        # 100 x 300: no block size divides N or K (masked K tail, clamped rows past N).
        return [
            *(GemmCase(f"m{m}_default", m, 100, 300, bias=m % 2 == 1) for m in (1, 3, 8, 16)),
            GemmCase("m1_sum_split2", 1, 64, 256, True, SkinnyConfig(16, 64, split_k=2)),
            GemmCase("m3_sum", 3, 40, 72, False, SkinnyConfig(16, 64)),
            GemmCase("m8_dot", 8, 100, 300, True, SkinnyConfig(16, 32, dot=True)),
            GemmCase("m16_dot_split3", 16, 100, 300, True, SkinnyConfig(32, 64, split_k=3, dot=True)),
            # Sum mode holds at most 16 rows per program: 20 rows take two row blocks.
            GemmCase("m20_sum_row_blocks", 20, 24, 48, True, SkinnyConfig(8, 32)),
            GemmCase("m20_dot_split2", 20, 48, 96, False, SkinnyConfig(16, 32, split_k=2, dot=True)),
        ]  # fmt: skip
    return [
        *(
            GemmCase(f"{name}_m{m}", m, n, k, bias=name == "qkv")
            for name, (n, k) in _LLAMA_8B_LINEARS.items()
            for m in (1, 3, 8, 16)
        ),
        GemmCase("o_m1_sum_split4", 1, 4096, 4096, False, SkinnyConfig(16, 256, split_k=4)),
        GemmCase("o_m8_dot_split2", 8, 4096, 4096, True, SkinnyConfig(64, 128, split_k=2, dot=True)),
        GemmCase("odd_m5", 5, 1000, 3000, True),
    ]  # fmt: skip


@pytest.mark.parametrize(("target", "case"), _params(_gemm_cases))
def test_skinny_gemm_matches_ref(target: Target, case: GemmCase) -> None:
    generator = _generator(case, target.id)
    x = _randn((case.m, case.k), target, generator)
    weight = _randn((case.n, case.k), target, generator, scale=case.k**-0.5)
    bias = _randn((case.n,), target, generator) if case.bias else None
    out = skinny_gemm(x, weight, bias, out=_poison((case.m, case.n), target), config=case.config)
    _assert_close(out, ref_skinny_gemm.skinny_gemm(x, weight, bias), target.dtype)


@pytest.mark.parametrize("target", [t for t in TARGETS if not t.gpu], ids=lambda t: t.id)
@pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1 (no GPU present)")
def test_skinny_gemm_views_and_leading_dims(target: Target) -> None:
    """x [2, 3, K] as a column slice of a wider tensor (row stride != K), a new output."""
    generator = _generator("gemm_views", target.id)
    wide = _randn((2, 3, 80), target, generator)
    x = wide[..., 8:56]
    weight = _randn((30, 48), target, generator, scale=48**-0.5)
    out = skinny_gemm(x, weight)
    _assert_close(out, ref_skinny_gemm.skinny_gemm(x, weight), target.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("split_k", [1, 4])
def test_skinny_gemm_replays_in_cuda_graph_without_syncs(split_k: int) -> None:
    """No host syncs (the split-K workspace included), and a captured launch replays over new x."""
    target = Target("cuda", torch.bfloat16)
    generator = _generator("gemm_graph", split_k)
    x = _randn((4, 4096), target, generator)
    weight = _randn((4096, 4096), target, generator, scale=4096**-0.5)
    bias = _randn((4096,), target, generator)
    config = SkinnyConfig(32, 128, split_k=split_k, dot=True)
    skinny_gemm(x, weight, bias, config=config)  # warm-up: compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        skinny_gemm(x, weight, bias, config=config)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_gemm(x, weight, bias, config=config)
    x.copy_(_randn(tuple(x.shape), target, generator))
    graph.replay()
    _assert_close(out, ref_skinny_gemm.skinny_gemm(x, weight, bias), target.dtype)


# ----------------------------------------------------------------------------------------------
# Dispatch


def test_ops_on_cpu_are_the_refs_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(7)
    x, residual = torch.randn(4, 32, generator=generator), torch.randn(4, 32, generator=generator)
    weight = torch.randn(32, generator=generator)
    assert not ops.use_triton(x)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), ref_rms_norm.rms_norm(x, weight, 1e-6))
    for got, want in zip(
        ops.fused_add_rms_norm(x, residual, weight, 1e-6),
        ref_rms_norm.fused_add_rms_norm(x, residual, weight, 1e-6),
        strict=True,
    ):
        assert torch.equal(got, want)
    assert torch.equal(ops.silu_and_mul(x), ref_activation.silu_and_mul(x))
    cache = torch.randn(16, 32, generator=generator)
    positions = torch.tensor([3, 0, 15, 7])
    q, k = x.view(4, 1, 32), residual.view(4, 1, 32)
    for got, want in zip(
        ops.apply_rotary(positions, q, k, cache),
        ref_rotary.rotary_embedding(positions, q, k, cache),
        strict=True,
    ):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_ops_on_cuda_use_triton() -> None:
    target = Target("cuda", torch.bfloat16)
    generator = _generator("ops", target.id)
    x = _randn((16, 256), target, generator)
    weight = 1 + _randn((256,), target, generator, scale=0.3)
    assert ops.use_triton(x)
    _assert_close(ops.rms_norm(x, weight, 1e-6), ref_rms_norm.rms_norm(x, weight, 1e-6), x.dtype)
    _assert_close(ops.silu_and_mul(x), ref_activation.silu_and_mul(x), x.dtype)


# ----------------------------------------------------------------------------------------------
# Zero-stall: no host syncs, CUDA-graph capture


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_triton_backend_has_no_host_syncs() -> None:
    target = Target("cuda", torch.bfloat16)
    for case in (_prefill_cases(target)[2], _decode_cases(target)[2]):
        inputs = _paged_inputs(case, target)
        cache = KVCache(inputs.key_cache, inputs.value_cache)
        generator = _generator("sync", case.name)
        k = _randn((inputs.meta.num_tokens, case.kv_heads, case.head_dim), target, generator)
        v = _randn((inputs.meta.num_tokens, case.kv_heads, case.head_dim), target, generator)
        backend = get_attention_backend("triton")
        # Compile outside the checked region (first launches load modules).
        backend.forward(inputs.q, k, v, cache, inputs.meta, inputs.scale, case.window)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.forward(inputs.q, k, v, cache, inputs.meta, inputs.scale, case.window)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 700])
def test_decode_replays_in_cuda_graph(window: int | None) -> None:
    """Capture one decode step of a padded batch, then replay it over other lengths, blocks and
    inputs written into the same buffers: the replay must match the reference for the new values."""
    target = Target("cuda", torch.bfloat16)
    heads, kv_heads, head_dim, block_size, batch = 32, 8, 128, 16, 24
    backend = get_attention_backend("triton")
    generator = _generator("graph", window)
    num_blocks = batch * -(-3000 // block_size) + 8
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = KVCache(_randn(shape, target, generator), _randn(shape, target, generator))

    def decode_meta(lengths: list[int]) -> AttentionMetadata:
        tables = random_block_tables([3000] * batch, block_size, num_blocks, generator)
        return build_metadata([1] * batch, lengths, tables, block_size, target.device)

    static = decode_meta(_random_lengths(batch, 3000, 8, ones=2))
    q = _randn((batch, heads, head_dim), target, generator)
    k = _randn((batch, kv_heads, head_dim), target, generator)
    v = _randn((batch, kv_heads, head_dim), target, generator)
    backend.forward(q, k, v, cache, static, head_dim**-0.5, window)  # warm-up: compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, static, head_dim**-0.5, window)

    for seed in (9, 10):
        fresh = decode_meta(_random_lengths(batch, 3000, seed, ones=3))
        # The last two rows pad the batch to the captured size, as the runner does.
        fresh.seq_lens[-2:] = 0
        fresh.seq_lens_cpu[-2:] = 0
        fresh.slot_mapping[-2:] = -1
        for buffer, value in (
            (static.seq_lens, fresh.seq_lens),
            (static.block_tables, fresh.block_tables),
            (static.slot_mapping, fresh.slot_mapping),
            (q, _randn(tuple(q.shape), target, generator)),
            (k, _randn(tuple(k.shape), target, generator)),
            (v, _randn(tuple(v.shape), target, generator)),
        ):
            buffer.copy_(value)
        graph.replay()
        # The replay wrote k and v into the cache; the reference reads that cache.
        ref = paged_attention(
            q,
            cache.key,
            cache.value,
            fresh.query_start_loc_cpu,
            fresh.seq_lens_cpu,
            fresh.block_tables,
            head_dim**-0.5,
            window,
        )
        _assert_close(out, ref, target.dtype)
