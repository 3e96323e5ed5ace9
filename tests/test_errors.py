"""Bad input gets a clear error naming the value and what is accepted; the engine keeps serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nostall import LLM, SamplingParams
from nostall.errors import ConfigError, InvalidRequestError, ModelLoadError


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"n": 0}, "n=0"),
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"min_p": 2.0}, "min_p=2.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
        ({"stop": [""]}, "stop="),
        ({"logprobs": -1}, "logprobs=-1"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens=5"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"tempreature": 0.5}, "tempreature"),
    ],
)
def test_bad_sampling_params_name_the_value_and_the_range(
    kwargs: dict[str, object], needle: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert needle in msg and "accepted" in msg


def test_missing_and_corrupt_model_paths(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        LLM(str(empty))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        LLM(str(broken))
    bad_gguf = tmp_path / "model.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match=r"model\.gguf"):
        LLM(str(bad_gguf))


def test_unsupported_architecture_lists_the_supported(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ModelLoadError) as e:
        LLM(str(d))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_unknown_engine_option(smollm2_gguf: str) -> None:
    with pytest.raises(ConfigError, match=r"max_num_seq'.*accepted"):
        LLM(smollm2_gguf, max_num_seq=4)


def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(smollm2_llm: LLM) -> None:
    engine = smollm2_llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=10)
    expected = smollm2_llm.generate(["Good morning", "The sun is"], greedy, use_tqdm=False)

    # Two good requests in flight; bad ones arrive between steps.
    engine.add_request("good-1", "Good morning", greedy)
    engine.add_request("good-2", "The sun is", greedy)
    engine.step()
    limit = engine.config.scheduler.max_model_len
    bad_inputs: list[tuple[object, SamplingParams | None, str]] = [
        ("", greedy, "empty"),
        ([], greedy, "empty"),
        ([1] * limit, greedy, f"max_model_len is {limit}"),
        ("x " * (limit + 10), greedy, "max_model_len"),
        ([10**9], greedy, "out of range"),
        (12345, greedy, "int"),
        ("ok", "not params", "SamplingParams"),
        ("ok", SamplingParams(logprobs=50), "logprobs=50"),
    ]
    for i, (prompt, params, needle) in enumerate(bad_inputs):
        with pytest.raises(InvalidRequestError, match=needle):
            engine.add_request(f"bad-{i}", prompt, params)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good-1", "again", greedy)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["good-1"].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert done["good-2"].outputs[0].token_ids == expected[1].outputs[0].token_ids

    # generate() validates every prompt before queueing any: nothing half-runs.
    with pytest.raises(InvalidRequestError):
        smollm2_llm.generate(["fine", ""], greedy, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 3 prompts"):
        smollm2_llm.generate(["a", "b", "c"], [greedy, greedy], use_tqdm=False)
    again = smollm2_llm.generate(["Good morning"], greedy, use_tqdm=False)
    assert again[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_abort_frees_blocks_at_any_point(smollm2_llm: LLM) -> None:
    engine = smollm2_llm.llm_engine
    kv = engine.kv_cache_manager
    engine.add_request("a-wait", "never scheduled", SamplingParams(max_tokens=5))
    engine.abort_request("a-wait")
    engine.add_request("a-run", "a running request", SamplingParams(max_tokens=50, n=3))
    engine.step()
    engine.step()
    assert kv.usage > 0
    engine.abort_request(["a-run", "unknown-id"])
    assert kv.usage == 0
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "nostall.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_cli_generate_prints_the_completion(smollm2_gguf: str, smollm2_llm: LLM) -> None:
    r = _cli(
        "generate",
        "--model",
        smollm2_gguf,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "12",
        "--max-model-len",
        "256",
    )
    assert r.returncode == 0, r.stderr
    want = (
        smollm2_llm.generate(
            ["The capital of France is"],
            SamplingParams(temperature=0, max_tokens=12),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert r.stdout == want + "\n"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "/nonexistent/model", "--prompt", "hi"], "/nonexistent/model"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature=-1.0"),
        (["--prompt", "", "--max-model-len", "64"], "empty"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(
    smollm2_gguf: str, args: list[str], needle: str
) -> None:
    if "--model" not in args:
        args = ["--model", smollm2_gguf, *args]
    r = _cli("generate", *args)
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("nostall generate: error:") and needle in lines[0]
    assert "Traceback" not in r.stderr


def test_dummy_weights_and_no_tokenizer(tmp_path, tiny_model) -> None:  # type: ignore[no-untyped-def]
    """load_format='dummy' needs only config.json; skip_tokenizer_init serves token ids only."""
    src = tiny_model("llama").path
    d = tmp_path / "config-only"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(d), skip_tokenizer_init=True)
    llm = LLM(str(d), load_format="dummy", skip_tokenizer_init=True, block_size=4)
    out = llm.generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].text == ""
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(stop="x"), use_tqdm=False)
    with pytest.raises(ConfigError, match="load_format='random'"):
        LLM(str(d), load_format="random")
