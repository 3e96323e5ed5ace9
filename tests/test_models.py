"""Models and loader against transformers, float32 on CPU.

Tolerance: our logits may differ from transformers' by at most 1e-4 times the largest reference logit
magnitude (float32 reassociation in fused projections and attention; measured ~1e-6 relative).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import GGUF_CONFIGS, TINY_CONFIGS, TinyModel
from helpers import PagedRequests
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from nostall.config import ModelConfig
from nostall.errors import ConfigError, ModelLoadError
from nostall.models.loader import load_model, resolve_model_config
from nostall.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

RTOL = 1e-4
TINY = list(TINY_CONFIGS)

# SmolLM2 tokenizer ids of a few prompts (hard-coded: loading the GGUF tokenizer costs seconds).
SMOLLM2_PROMPTS = [
    [504, 3575, 282, 4649, 314],  # "The capital of France is"
    [1604, 3987, 46477, 24, 94, 727],  # "def fibonacci(n):"
    # "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198],
]


def _hf_logits(hf_model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Returns the max abs difference, checked against RTOL times the reference's scale."""
    diff = (ours - ref).abs().max().item()
    assert diff <= RTOL * ref.abs().max().item(), f"max |diff| {diff} vs scale {ref.abs().max()}"
    return diff


@pytest.fixture(scope="module")
def loaded(
    tiny_model: Callable[[str], TinyModel],
) -> Callable[[str], tuple[ModelConfig, nn.Module]]:
    cache: dict[str, tuple[ModelConfig, nn.Module]] = {}

    def get(name: str) -> tuple[ModelConfig, nn.Module]:
        if name not in cache:
            cfg = resolve_model_config(str(tiny_model(name).path))
            cache[name] = (cfg, load_model(cfg, torch.device("cpu")))
        return cache[name]

    return get


def _random_sequences(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("name", TINY)
def test_flat_paged_prefill_matches_transformers(
    name: str,
    tiny_model: Callable[[str], TinyModel],
    loaded: Callable[[str], tuple[ModelConfig, nn.Module]],
) -> None:
    cfg, model = loaded(name)
    hf_model = tiny_model(name).hf_model
    seqs = _random_sequences([5, 19, 12], cfg.vocab_size, seed=1)
    paged = PagedRequests.allocate(
        [len(s) for s in seqs], cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    )
    input_ids, positions, ctx = paged.step(seqs, [0, 0, 0])
    with torch.no_grad():
        hidden = model(input_ids, positions, ctx)
        logits = model.compute_logits(hidden)
    assert hidden.shape == (len(input_ids), cfg.hf_config.hidden_size)
    assert logits.dtype == torch.float32 and logits.shape == (len(input_ids), cfg.vocab_size)
    start = 0
    for seq in seqs:
        _assert_close(logits[start : start + len(seq)], _hf_logits(hf_model, seq))
        start += len(seq)


# Tokens each request computes per step: a prefill of a prefix, then chunks and single-token decodes.
INCREMENTAL_PLAN = [[4, 9, 1], [1, 3, 2], [1, 1, 5], [6, 1, 1], [1, 4, 1], [1, 1, 7]]


@pytest.mark.parametrize("name", TINY)
def test_incremental_decode_matches_full_forward(
    name: str,
    tiny_model: Callable[[str], TinyModel],
    loaded: Callable[[str], tuple[ModelConfig, nn.Module]],
) -> None:
    cfg, model = loaded(name)
    lengths = [sum(step[r] for step in INCREMENTAL_PLAN) for r in range(3)]
    seqs = _random_sequences(lengths, cfg.vocab_size, seed=2)
    refs = [_hf_logits(tiny_model(name).hf_model, s) for s in seqs]
    paged = PagedRequests.allocate(lengths, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, seed=3)
    cached = [0, 0, 0]
    for step in INCREMENTAL_PLAN:
        ends = [c + n for c, n in zip(cached, step, strict=True)]
        input_ids, positions, ctx = paged.step(
            [s[:e] for s, e in zip(seqs, ends, strict=True)], cached
        )
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, positions, ctx))
        start = 0
        for r, n in enumerate(step):
            _assert_close(logits[start : start + n], refs[r][cached[r] : ends[r]])
            start += n
        cached = ends


def test_smollm2_gguf_logits_match_transformers(
    smollm2_gguf: str, hf_smollm2: PreTrainedModel
) -> None:
    cfg = resolve_model_config(smollm2_gguf)
    assert (cfg.architecture, cfg.dtype, cfg.max_model_len) == (
        "LlamaForCausalLM",
        torch.float32,
        8192,
    )
    assert cfg.eos_token_ids == (2,) and cfg.tokenizer_dir == str(Path(smollm2_gguf).parent)
    model = load_model(cfg, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    paged = PagedRequests.allocate(
        [len(p) + 8 for p in SMOLLM2_PROMPTS],
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        block_size=16,
    )
    input_ids, positions, ctx = paged.step(SMOLLM2_PROMPTS, [0] * len(SMOLLM2_PROMPTS))
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, ctx))
    start = 0
    for prompt in SMOLLM2_PROMPTS:
        _assert_close(logits[start : start + len(prompt)], _hf_logits(hf_smollm2, prompt))
        start += len(prompt)

    # Greedy decoding through the paged cache, all prompts batched, equals transformers.generate
    # (which stops a prompt at its end-of-sequence token).
    seqs = [list(p) for p in SMOLLM2_PROMPTS]
    last = torch.tensor([len(p) for p in seqs]).cumsum(0) - 1
    for _ in range(8):
        for seq, token in zip(seqs, logits[last].argmax(-1).tolist(), strict=True):
            seq.append(token)
        input_ids, positions, ctx = paged.step(seqs, [len(s) - 1 for s in seqs])
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, positions, ctx))
        last = torch.arange(len(seqs))
    for prompt, seq in zip(SMOLLM2_PROMPTS, seqs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_smollm2.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
            )[0].tolist()
        assert seq[: len(ref)] == ref
        assert len(ref) == len(seq) or ref[-1] in cfg.eos_token_ids


@pytest.mark.parametrize("name", list(GGUF_CONFIGS))
def test_tiny_gguf_matches_transformers_reading_it(
    name: str, tiny_gguf: Callable[[str], TinyModel]
) -> None:
    """Our GGUF path (name map, dim order, llama Q/K un-permutation) against transformers' own."""
    tiny = tiny_gguf(name)
    cfg = resolve_model_config(str(tiny.path))
    model = load_model(cfg, torch.device("cpu"))
    hf_model = AutoModelForCausalLM.from_pretrained(
        tiny.path.parent, gguf_file=tiny.path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    seqs = _random_sequences([6, 11], cfg.vocab_size, seed=5)
    paged = PagedRequests.allocate(
        [len(s) for s in seqs], cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    )
    with torch.no_grad():
        logits = model.compute_logits(model(*paged.step(seqs, [0, 0])))
    for start, seq in zip((0, 6), seqs, strict=True):
        ref = _hf_logits(hf_model, seq)
        _assert_close(logits[start : start + len(seq)], ref)
        # The file round-trips the original model, so both also equal it.
        _assert_close(ref, _hf_logits(tiny.hf_model, seq))


def test_tied_and_untied_heads(loaded: Callable[[str], tuple[ModelConfig, nn.Module]]) -> None:
    _, tied = loaded("llama_tied")
    _, untied = loaded("llama")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_sliding_windows_follow_transformers(
    loaded: Callable[[str], tuple[ModelConfig, nn.Module]],
) -> None:
    windows = {
        name: [layer.self_attn.attn.sliding_window for layer in loaded(name)[1].model.layers]
        for name in ("llama", "mistral", "qwen2", "qwen3")
    }
    assert windows == {
        "llama": [None, None],
        "mistral": [8, 8],
        "qwen2": [None, 6],
        "qwen3": [None, None],
    }


def test_bfloat16_load_and_float32_logits(tiny_model: Callable[[str], TinyModel]) -> None:
    cfg = resolve_model_config(str(tiny_model("qwen2").path), dtype="bfloat16")
    model = load_model(cfg, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    seqs = _random_sequences([9], cfg.vocab_size, seed=4)
    paged = PagedRequests.allocate(
        [9], cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16
    )
    with torch.no_grad():
        logits = model.compute_logits(model(*paged.step(seqs, [0])))
    ref = _hf_logits(tiny_model("qwen2").hf_model, seqs[0])
    assert logits.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(logits, ref, dim=-1).min() > 0.99


def test_sharded_checkpoint_has_an_index(tiny_model: Callable[[str], TinyModel]) -> None:
    path = tiny_model("qwen3").path
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1


def test_resolve_defaults_and_eos(tiny_model: Callable[[str], TinyModel], tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model("llama").path, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    cfg = resolve_model_config(str(model_dir), max_model_len=64)
    assert cfg.eos_token_ids == (2, 7)
    assert (cfg.max_model_len, cfg.dtype, cfg.gguf_file) == (64, torch.float32, None)
    assert cfg.tokenizer_dir == str(model_dir)
    assert resolve_model_config(str(model_dir), dtype=torch.float16).dtype == torch.float16
    assert resolve_model_config(str(model_dir), device="cuda").dtype == torch.bfloat16
    assert resolve_model_config(str(model_dir)).max_model_len == 128


def test_registry_lists_supported_architectures() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }
    with pytest.raises(ModelLoadError, match=r"'GPT2LMHeadModel'.*Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


# --- loader errors: each names the offending value and what is accepted ---


def _copy_tiny(tiny_model: Callable[[str], TinyModel], tmp_path: Path) -> Path:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model("llama").path, model_dir)
    return model_dir


def test_error_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"nowhere.*does not exist"):
        resolve_model_config(str(tmp_path / "nowhere"))


def test_error_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no config\.json.*pass the file itself"):
        resolve_model_config(str(tmp_path))


def test_error_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"weights\.bin.*not a \.gguf"):
        resolve_model_config(str(tmp_path / "weights.bin"))


def test_error_corrupt_config(tiny_model: Callable[[str], TinyModel], tmp_path: Path) -> None:
    model_dir = _copy_tiny(tiny_model, tmp_path)
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json.*unreadable"):
        resolve_model_config(str(model_dir))


def test_error_unsupported_architecture(
    tiny_model: Callable[[str], TinyModel], tmp_path: Path
) -> None:
    model_dir = _copy_tiny(tiny_model, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        resolve_model_config(str(model_dir))


def test_error_no_safetensors(tiny_model: Callable[[str], TinyModel], tmp_path: Path) -> None:
    model_dir = _copy_tiny(tiny_model, tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no safetensors weights"):
        resolve_model_config(str(model_dir))


def test_error_truncated_safetensors(
    tiny_model: Callable[[str], TinyModel], tmp_path: Path
) -> None:
    model_dir = _copy_tiny(tiny_model, tmp_path)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cfg = resolve_model_config(str(model_dir))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*corrupt or truncated"):
        load_model(cfg, torch.device("cpu"))


def test_error_missing_parameter(tiny_model: Callable[[str], TinyModel], tmp_path: Path) -> None:
    model_dir = _copy_tiny(tiny_model, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    cfg = resolve_model_config(str(model_dir))
    with pytest.raises(
        ModelLoadError,
        match=r"2 parameters.*layers\.1\.mlp\.gate_up_proj\.weight.*model\.norm\.weight",
    ):
        load_model(cfg, torch.device("cpu"))


def test_error_wrong_tensor_shape(tiny_model: Callable[[str], TinyModel], tmp_path: Path) -> None:
    model_dir = _copy_tiny(tiny_model, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, model_dir / "model.safetensors")
    cfg = resolve_model_config(str(model_dir))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight.*\(3, 64\).*\(32, 64\)"):
        load_model(cfg, torch.device("cpu"))


def test_error_truncated_gguf(smollm2_gguf: str, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as f:
        truncated.write_bytes(f.read(4_000_000))
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf.*corrupt or truncated"):
        load_model(resolve_model_config(str(truncated)), torch.device("cpu"))


def test_error_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"'gpt2'.*accepted: llama, qwen2, qwen3"):
        resolve_model_config(str(path))


def test_error_bad_dtype_and_max_model_len(tiny_model: Callable[[str], TinyModel]) -> None:
    path = str(tiny_model("llama").path)
    with pytest.raises(ConfigError, match=r"'int8'.*accepted: auto, float32, bfloat16, float16"):
        resolve_model_config(path, dtype="int8")
    with pytest.raises(ConfigError, match=r"torch\.float64.*accepted"):
        resolve_model_config(path, dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"max_model_len=4096.*max_position_embeddings=128"):
        resolve_model_config(path, max_model_len=4096)
