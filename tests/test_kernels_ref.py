"""The pure-torch reference kernels against independent formulations, on fresh random inputs."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from helpers import build_metadata, random_block_tables
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from nostall.errors import ConfigError
from nostall.kernels.ref.activation import silu_and_mul
from nostall.kernels.ref.kv_cache import write_kv_cache
from nostall.kernels.ref.paged_attention import paged_attention
from nostall.kernels.ref.rms_norm import fused_add_rms_norm, rms_norm
from nostall.layers.attention.backend import get_attention_backend
from nostall.layers.attention.metadata import KVCache
from nostall.layers.rotary import get_rope


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """One request, float64 SDPA with an explicit mask: q [q_len, H, D] are the last q_len positions
    of k, v [seq_len, KVH, D]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= query_pos - key_pos < window
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().repeat_interleave(group, dim=1).transpose(0, 1),
        v.double().repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


# (cached prefix length, new tokens) per request.
CASES = {
    "prefill": [(0, 7), (0, 1), (0, 16)],
    "chunked_prefill": [(5, 6), (16, 3), (1, 9)],
    "decode": [(12, 1), (1, 1), (30, 1), (7, 1)],
    "mixed": [(0, 11), (20, 1), (9, 4)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    ("heads", "kv_heads", "window"),
    [(4, 4, None), (4, 2, None), (6, 1, None), (4, 2, 5), (2, 1, 1)],
)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense(
    case: str, heads: int, kv_heads: int, window: int | None, block_size: int
) -> None:
    seed = zlib.crc32(repr((case, heads, kv_heads, window, block_size)).encode())
    generator = torch.Generator().manual_seed(seed)
    head_dim, scale = 8, 8**-0.5
    reqs = CASES[case]
    seq_lens = [c + n for c, n in reqs]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    tables = random_block_tables(seq_lens, block_size, num_blocks, generator)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"))
    value_cache = torch.full(cache_shape, float("nan"))
    ks = [torch.randn(n, kv_heads, head_dim, generator=generator) for n in seq_lens]
    vs = [torch.randn(n, kv_heads, head_dim, generator=generator) for n in seq_lens]
    qs = [torch.randn(n, heads, head_dim, generator=generator) for _, n in reqs]

    # The cached prefixes were written by an earlier step; this step writes the new tokens.
    prefix = [c for c, _ in reqs]
    if any(prefix):
        earlier = [(r, c) for r, c in enumerate(prefix) if c]
        meta = build_metadata(
            [c for _, c in earlier],
            [c for _, c in earlier],
            [tables[r] for r, _ in earlier],
            block_size,
        )
        write_kv_cache(
            torch.cat([ks[r][:c] for r, c in earlier]),
            torch.cat([vs[r][:c] for r, c in earlier]),
            key_cache,
            value_cache,
            meta.slot_mapping,
        )
    meta = build_metadata([n for _, n in reqs], seq_lens, tables, block_size)
    write_kv_cache(
        torch.cat([k[c:] for k, (c, _) in zip(ks, reqs, strict=True)]),
        torch.cat([v[c:] for v, (c, _) in zip(vs, reqs, strict=True)]),
        key_cache,
        value_cache,
        meta.slot_mapping,
    )
    out = paged_attention(
        torch.cat(qs),
        key_cache,
        value_cache,
        meta.query_start_loc_cpu,
        meta.seq_lens_cpu,
        meta.block_tables,
        scale,
        window,
    )
    expected = torch.cat(
        [_dense_attention(q, k, v, scale, window) for q, k, v in zip(qs, ks, vs, strict=True)]
    )
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)


def test_torch_backend_writes_then_attends() -> None:
    generator = torch.Generator().manual_seed(0)
    backend = get_attention_backend("torch")
    block_size, kv_heads, head_dim = 4, 2, 8
    tables = random_block_tables([6, 3], block_size, 6, generator)
    meta = build_metadata([6, 3], [6, 3], tables, block_size)
    q = torch.randn(9, 4, head_dim, generator=generator)
    k = torch.randn(9, kv_heads, head_dim, generator=generator)
    v = torch.randn(9, kv_heads, head_dim, generator=generator)
    cache = KVCache(
        torch.full((6, block_size, kv_heads, head_dim), float("nan")),
        torch.full((6, block_size, kv_heads, head_dim), float("nan")),
    )
    out = backend.forward(q, k, v, cache, meta, 0.5, None)
    expected = torch.cat(
        [
            _dense_attention(q[:6], k[:6], v[:6], 0.5, None),
            _dense_attention(q[6:], k[6:], v[6:], 0.5, None),
        ]
    )
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"'flash'.*accepted: torch"):
        get_attention_backend("flash")


def test_paged_attention_returns_input_dtype() -> None:
    generator = torch.Generator().manual_seed(1)
    tables = random_block_tables([5], 2, 4, generator)
    meta = build_metadata([5], [5], tables, 2)
    k = torch.randn(5, 1, 16, generator=generator)
    v = torch.randn(5, 1, 16, generator=generator)
    q = torch.randn(5, 2, 16, generator=generator)
    key_cache = torch.zeros(4, 2, 1, 16, dtype=torch.bfloat16)
    value_cache = torch.zeros(4, 2, 1, 16, dtype=torch.bfloat16)
    write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    out = paged_attention(
        q.bfloat16(),
        key_cache,
        value_cache,
        meta.query_start_loc_cpu,
        meta.seq_lens_cpu,
        meta.block_tables,
        0.25,
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), _dense_attention(q, k, v, 0.25, None).float(), rtol=0.05, atol=0.05
    )


def test_write_kv_cache_scatters_to_slots() -> None:
    generator = torch.Generator().manual_seed(2)
    key_cache = torch.randn(5, 4, 2, 3, generator=generator)
    value_cache = torch.randn(5, 4, 2, 3, generator=generator)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    slots = torch.tensor([17, 3, 8, 19])
    k = torch.randn(4, 2, 3, generator=generator)
    v = torch.randn(4, 2, 3, generator=generator)
    write_kv_cache(k, v, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(key_cache[slot // 4, slot % 4], k[t])
        assert torch.equal(value_cache[slot // 4, slot % 4], v[t])
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(key_cache.view(20, 2, 3)[untouched], before_k.view(20, 2, 3)[untouched])
    assert torch.equal(value_cache.view(20, 2, 3)[untouched], before_v.view(20, 2, 3)[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(7, 64, generator=generator)).to(dtype)
    residual = torch.randn(7, 64, generator=generator).to(dtype)
    ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.3 * torch.randn(64, generator=generator))
        assert torch.equal(rms_norm(x, ref.weight, 1e-5), ref(x))
        out, new_residual = fused_add_rms_norm(x, residual, ref.weight, 1e-5)
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(out, ref(x + residual))


ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("rope", list(ROPE_PARAMETERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_transformers(rope: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(4)
    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=ROPE_PARAMETERS[rope],
    )
    positions = torch.randint(0, 256, (11,), generator=generator)
    q = torch.randn(11, 4, 32, generator=generator).to(dtype)
    k = torch.randn(11, 2, 32, generator=generator).to(dtype)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = get_rope(config, 32, 256)(positions, q.reshape(11, -1), k.reshape(11, -1))
    # Bit-identical with this torch build; the tolerance admits last-ulp cos/sin differences elsewhere.
    tol = {"rtol": 0, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.01, "atol": 0.02}
    torch.testing.assert_close(q_out.view(11, 4, 32), q_ref[0].transpose(0, 1), **tol)
    torch.testing.assert_close(k_out.view(11, 2, 32), k_ref[0].transpose(0, 1), **tol)


def test_rotary_rejects_length_dependent_rope() -> None:
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    with pytest.raises(ConfigError, match=r"'dynamic'.*sequence length.*accepted: default"):
        get_rope(config, 16, 128)


def test_silu_and_mul() -> None:
    x = torch.randn(5, 2 * 24, generator=torch.Generator().manual_seed(5))
    gate, up = x[:, :24], x[:, 24:]
    torch.testing.assert_close(silu_and_mul(x), gate * torch.sigmoid(gate) * up)
