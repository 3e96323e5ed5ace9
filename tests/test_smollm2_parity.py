"""SmolLM2-135M (GGUF) end to end: nostall's greedy output equals transformers.generate, float32 CPU.

Every engine variant (prefix caching, a chunked-prefill budget smaller than the prompts, a KV cache
small enough to force preemption) must give the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from nostall import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "In a distant galaxy, a small robot named Pixel discovered that the stars were not what they"
    " seemed. Every night it counted them, and every night there was one more.",
    "def fibonacci(n):",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Hi",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The"
    " quick brown fox jumps over the lazy dog. Translate this sentence into French:",
    "List three uses of a paperclip:",
]
SHARED = (
    "You are a careful assistant. Answer briefly and precisely, and never invent facts. If you do not"
    " know, say so. Keep every answer to one sentence. "
)
PREFIX_PROMPTS = [
    SHARED + q for q in ("What is 2+2?", "Name a prime number.", "What colour is the sky?")
] + [
    SHARED,
    SHARED + "What is 2+2? Explain.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_reference(hf_smollm2, smollm2_tokenizer):  # type: ignore[no-untyped-def]
    """transformers' greedy continuation (token ids) for every prompt, one prompt at a time."""
    out: dict[str, list[int]] = {}
    for p in PROMPTS + PREFIX_PROMPTS:
        ids = torch.tensor([smollm2_tokenizer.encode(p)])
        with torch.no_grad():
            gen = hf_smollm2.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        out[p] = gen[0, ids.shape[1] :].tolist()
    return out


def _greedy(llm: LLM, prompts: list[str]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    return {
        p: o.outputs[0].token_ids
        for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True)
    }


@pytest.fixture(scope="module")
def llm_default(smollm2_gguf: str) -> LLM:
    return LLM(smollm2_gguf, max_model_len=512)


def test_greedy_matches_transformers_batched(llm_default: LLM, hf_reference) -> None:  # type: ignore[no-untyped-def]
    ours = _greedy(llm_default, PROMPTS)
    for p in PROMPTS:
        assert ours[p] == hf_reference[p], p


def test_prefix_caching_hits_and_matches(llm_default: LLM, hf_reference) -> None:  # type: ignore[no-untyped-def]
    kv = llm_default.llm_engine.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    # First alone (fills the cache), then the rest, which share its long prefix.
    first = _greedy(llm_default, PREFIX_PROMPTS[:1])
    rest = _greedy(llm_default, PREFIX_PROMPTS[1:])
    shared_tokens = len(llm_default.get_tokenizer().encode(SHARED))
    assert (
        kv.prefix_cache_hits - hits_before
        >= (len(PREFIX_PROMPTS) - 1) * (shared_tokens // 16 - 1) * 16
    )
    for p, ids in {**first, **rest}.items():
        assert ids == hf_reference[p], p


def test_chunked_prefill_budget_smaller_than_prompts(smollm2_gguf: str, hf_reference) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(
        smollm2_gguf, max_model_len=512, max_num_batched_tokens=7, enable_prefix_caching=False
    )
    ours = _greedy(llm, PROMPTS)
    for p in PROMPTS:
        assert ours[p] == hf_reference[p], p


def test_preemption_under_a_small_kv_cache(smollm2_gguf: str, hf_reference) -> None:  # type: ignore[no-untyped-def]
    # 9 prompts of up to ~45 tokens + 32 new need ~35 blocks of 8; give 13 (96 usable tokens).
    llm = LLM(smollm2_gguf, max_model_len=96, block_size=8, num_gpu_blocks_override=13)
    ours = _greedy(llm, PROMPTS)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for p in PROMPTS:
        assert ours[p] == hf_reference[p], p
    assert llm.llm_engine.kv_cache_manager.usage == 0
