"""Logprobs, seeds, parallel samples, stop conditions and the chat API on the real SmolLM2 model."""

from __future__ import annotations

import pytest
import torch

from nostall import LLM, SamplingParams


def _hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_token_and_prompt_logprobs_match_transformers(smollm2_llm: LLM, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, prompt_logprobs=3)
    out = smollm2_llm.generate(["The three primary colours are"], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    full = out.prompt_token_ids + comp.token_ids
    ref = _hf_log_softmax(hf_smollm2, full)

    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for i in range(1, len(out.prompt_token_ids)):
        entry = out.prompt_logprobs[i]
        assert entry is not None
        tok = out.prompt_token_ids[i]
        assert abs(entry[tok].logprob - ref[i - 1, tok].item()) < 1e-4
        assert entry[tok].rank == int((ref[i - 1] > ref[i - 1, tok]).sum()) + 1
        top = ref[i - 1].topk(3)
        for r, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
            assert abs(entry[tid].logprob - lp) < 1e-4
            if tid != tok:
                assert entry[tid].rank == r + 1

    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    total = 0.0
    for j, tok in enumerate(comp.token_ids):
        row = ref[len(out.prompt_token_ids) + j - 1]
        entry = comp.logprobs[j]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert entry[tok].rank == 1  # greedy picks the argmax
        assert len(entry) == 5  # the chosen token is also the top-1
        top = row.topk(5)
        assert list(entry) == [tok] + [t for t in top.indices.tolist() if t != tok]
        total += row[tok].item()
    assert comp.cumulative_logprob is not None and abs(comp.cumulative_logprob - total) < 1e-3


def test_prompt_logprobs_survive_chunked_prefill(smollm2_gguf: str, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(smollm2_gguf, max_model_len=256, max_num_batched_tokens=5)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    out = llm.generate(
        ["A long prompt, chunked into pieces of five tokens each, still scores."],
        params,
        use_tqdm=False,
    )[0]
    ref = _hf_log_softmax(hf_smollm2, out.prompt_token_ids)
    assert out.prompt_logprobs is not None
    got = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i > 0]  # type: ignore[index]
    want = [ref[i - 1, t].item() for i, t in enumerate(out.prompt_token_ids) if i > 0]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_seeded_sampling_is_independent_of_the_batch(smollm2_llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = smollm2_llm.generate(["Once upon a time"], seeded, use_tqdm=False)[0].outputs[0]
    others = [
        ("Tell me a joke.", SamplingParams(temperature=1.0, max_tokens=30)),
        ("Once upon a time", SamplingParams(temperature=0, max_tokens=5)),
        ("Once upon a time", seeded),
        ("List the planets:", SamplingParams(temperature=0.5, top_k=20, max_tokens=40)),
    ]
    outs = smollm2_llm.generate([p for p, _ in others], [sp for _, sp in others], use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone.token_ids
    assert outs[2].outputs[0].text == alone.text
    different = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=24)
    assert (
        smollm2_llm.generate(["Once upon a time"], different, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
        != alone.token_ids
    )


def test_n_samples_share_the_prompt_blocks(smollm2_llm: LLM) -> None:
    engine = smollm2_llm.llm_engine
    bs = engine.config.cache.block_size
    prompt = (
        "Write a short poem about autumn leaves falling gently to the ground, in the style of a haiku,"
        " and then explain in two sentences why the seasons change on our planet."
    )
    n_prompt = len(engine.tokenizer.encode(prompt))
    engine.kv_cache_manager.reset_prefix_cache()
    engine.add_request(
        "n4", prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    )
    free_before = engine.kv_cache_manager.num_free_blocks
    engine.step()
    tables = [engine.kv_cache_manager.get_block_ids(f"n4#{i}") for i in range(4)]
    full = n_prompt // bs
    shared = (n_prompt - 1) // bs
    assert full >= 2
    for t in tables[1:]:
        assert t[:shared] == tables[0][:shared]
    used = free_before - engine.kv_cache_manager.num_free_blocks
    # One private copy would cost 4 x ceil((n+1)/bs); sharing costs the prompt once plus tails.
    assert used == len(tables[0]) + 3 * (len(tables[0]) - shared)
    assert used < 4 * len(tables[0])
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    final = next(o for o in outs if o.finished)
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    texts = {c.text for c in final.outputs}
    assert len(texts) > 1  # four distinct random samples
    # Seeded n>1 is reproducible.
    again = smollm2_llm.generate(
        [prompt],
        SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in final.outputs]


def test_stop_string_spanning_tokens_ends_generation(smollm2_llm: LLM) -> None:
    tok = smollm2_llm.get_tokenizer()
    base = smollm2_llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False
    )[0].outputs[0]
    ids = base.token_ids
    # A stop string made of the text of tokens 3..5 (three tokens), cut so it starts mid-token.
    piece = tok.decode(ids[3:6])
    stop = piece[1:] if len(piece) > 3 else piece
    assert stop and stop in base.text
    out = smollm2_llm.generate(
        ["The capital of France is"],
        SamplingParams(temperature=0, max_tokens=32, stop=[stop, "never-appears-xyz"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < len(ids)
    kept = smollm2_llm.generate(
        ["The capital of France is"],
        SamplingParams(temperature=0, max_tokens=32, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == base.text[: base.text.index(stop) + len(stop)]


def test_stop_token_ids_min_tokens_max_tokens_ignore_eos(smollm2_llm: LLM) -> None:
    base = smollm2_llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )
    ids = base[0].outputs[0].token_ids
    stop_id = ids[4]
    first = ids.index(stop_id)
    out = smollm2_llm.generate(
        ["1, 2, 3, 4,"],
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert (
        out.token_ids == ids[: first + 1]
        and out.finish_reason == "stop"
        and out.stop_reason == stop_id
    )
    # min_tokens holds stop tokens back: the first occurrence cannot end it.
    held = smollm2_llm.generate(
        ["1, 2, 3, 4,"],
        SamplingParams(
            temperature=0, max_tokens=20, stop_token_ids=[stop_id], min_tokens=first + 2
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(held.token_ids) >= first + 2
    assert stop_id not in held.token_ids[: first + 2]
    length = smollm2_llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    assert (
        length[0].outputs[0].finish_reason == "length" and len(length[0].outputs[0].token_ids) == 3
    )
    # The chat model ends its reply with <|im_end|> (EOS); ignore_eos runs on to max_tokens.
    conv = [{"role": "user", "content": "What is 2+2?"}]
    short = smollm2_llm.chat(conv, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[
        0
    ].outputs[0]
    assert (
        short.finish_reason == "stop"
        and short.token_ids[-1] in smollm2_llm.llm_engine.eos_token_ids
    )
    assert "<|im_end|>" not in short.text
    long = smollm2_llm.chat(
        conv,
        SamplingParams(temperature=0, max_tokens=len(short.token_ids) + 5, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert long.finish_reason == "length" and len(long.token_ids) == len(short.token_ids) + 5


def test_penalties_change_greedy_output_and_stay_valid(smollm2_llm: LLM) -> None:
    prompt = "Repeat after me: la la la la la la"
    plain = smollm2_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
    )
    pen = smollm2_llm.generate(
        [prompt],
        SamplingParams(
            temperature=0,
            max_tokens=16,
            repetition_penalty=1.5,
            frequency_penalty=1.0,
            presence_penalty=1.0,
        ),
        use_tqdm=False,
    )
    a, b = plain[0].outputs[0].token_ids, pen[0].outputs[0].token_ids
    assert a != b
    # Repetition is discouraged: fewer repeated tokens in the penalised output.
    assert len(set(b)) / len(b) >= len(set(a)) / len(a)


def test_outputs_keep_prompt_order_and_tqdm(
    smollm2_llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = ["a" * (i + 1) for i in range(6)]
    outs = smollm2_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=True)
    assert [o.prompt for o in outs] == prompts
    assert all(o.finished for o in outs)
    assert "Processed prompts" in capsys.readouterr().err
    tok_prompt = smollm2_llm.get_tokenizer().encode("Hello")
    by_ids = smollm2_llm.generate(
        tok_prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    by_text = smollm2_llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    assert by_ids[0].outputs[0].token_ids == by_text[0].outputs[0].token_ids
    assert by_ids[0].prompt is None and by_ids[0].prompt_token_ids == tok_prompt


def test_chat_applies_the_template(smollm2_llm: LLM) -> None:
    conv = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    out = smollm2_llm.chat(conv, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    tok = smollm2_llm.get_tokenizer()
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")
    two = smollm2_llm.chat(
        [conv, conv[1:]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids[:4]


def test_finished_requests_free_every_block(smollm2_llm: LLM) -> None:
    engine = smollm2_llm.llm_engine
    smollm2_llm.generate(
        ["x", "y z"], SamplingParams(temperature=0.5, max_tokens=4, n=2), use_tqdm=False
    )
    assert engine.kv_cache_manager.usage == 0
    assert not engine.has_unfinished_requests()
