"""Every supported architecture end to end: batched greedy output equals transformers.generate.

Tiny random models (tests/conftest.py) get the SmolLM2 tokenizer saved beside them, so the engine
starts as it would on a real checkpoint; prompts are token ids.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from nostall import LLM, SamplingParams

NEW_TOKENS = 32
ARCHS = ["llama", "llama_tied", "mistral", "qwen2", "qwen3"]


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 7, 12, 16, 17, 25, 40]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _hf_greedy(hf_model, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def with_tokenizer(
    tiny_model, smollm2_tokenizer
) -> Callable[[str], tuple[str, object, list[list[int]], list[list[int]]]]:  # type: ignore[no-untyped-def]
    """name -> (model dir, transformers model, prompts, transformers' greedy continuations)."""
    cache: dict[str, tuple[str, object, list[list[int]], list[list[int]]]] = {}

    def get(name: str) -> tuple[str, object, list[list[int]], list[list[int]]]:
        if name not in cache:
            tm = tiny_model(name)
            smollm2_tokenizer.save_pretrained(tm.path)
            prompts = _prompts(tm.hf_model.config.vocab_size, seed=len(name))
            cache[name] = (
                str(tm.path),
                tm.hf_model,
                prompts,
                [_hf_greedy(tm.hf_model, p) for p in prompts],
            )
        return cache[name]

    return get


def _ours(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name", ARCHS)
def test_batched_greedy_matches_transformers(with_tokenizer, name: str) -> None:  # type: ignore[no-untyped-def]
    path, _, prompts, want = with_tokenizer(name)
    llm = LLM(path, block_size=4)
    assert _ours(llm, prompts) == want


def test_synchronous_scheduling_gives_the_same_tokens(with_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Async scheduling (the default, results one step late) and sync scheduling agree."""
    path, _, prompts, want = with_tokenizer("llama")
    llm = LLM(path, block_size=4, async_scheduling=False)
    assert _ours(llm, prompts) == want


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_prefix_chunked_and_preempted_variants_match(with_tokenizer, name: str) -> None:  # type: ignore[no-untyped-def]
    path, hf_model, prompts, want = with_tokenizer(name)
    # Prompts sharing long prefixes: the prefix cache serves their first blocks.
    shared = prompts[-1][:30]
    prefix_prompts = [shared + p[:5] for p in prompts[:4]]
    prefix_want = [_hf_greedy(hf_model, p) for p in prefix_prompts]
    llm = LLM(path, block_size=4)
    first = _ours(llm, prefix_prompts[:1])
    rest = _ours(llm, prefix_prompts[1:])
    assert first + rest == prefix_want
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits >= 3 * 28

    chunked = LLM(path, block_size=4, max_num_batched_tokens=5)
    assert _ours(chunked, prompts) == want

    # 8 prompts of up to 40 tokens + 32 new: ~150 blocks of 4 if all ran at once; give 25.
    small = LLM(path, block_size=4, num_gpu_blocks_override=25, max_model_len=96)
    assert _ours(small, prompts) == want
    assert small.llm_engine.scheduler.num_preemptions_total > 0
    assert small.llm_engine.kv_cache_manager.usage == 0
