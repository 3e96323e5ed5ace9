"""The benchmark suite on the CPU: the cost model and roofline arithmetic, result files, trace
parsing, and smoke runs of every benchmark on a tiny random Llama (a few seconds each)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig

# The benchmarks package lives at the repository root, outside the installed src/ layout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_decode, bench_offline, bench_overhead, common
from benchmarks.bench_offline import MAX_LEN, MIN_LEN, sharegpt_like_lengths
from benchmarks.bench_overhead import host_clock, kernel_activity, union_length
from nostall.engine.args import EngineArgs
from nostall.engine.llm_engine import LLMEngine
from nostall.sampling_params import SamplingParams

# Llama-3.1-8B: 8,030,261,248 parameters, 128256 x 4096 of them in the embedding table.
LLAMA_8B_PARAMS = 8_030_261_248
LLAMA_8B_EMBEDDING = 128_256 * 4096


def _llama_8b() -> PretrainedConfig:
    return AutoConfig.from_pretrained(str(common.LLAMA_8B_DIR), local_files_only=True)


def _hf_param_count(config: PretrainedConfig) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# ---- cost model -------------------------------------------------------------------------------


def test_llama_8b_config_shape() -> None:
    c = _llama_8b()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (4096, 32, 32)
    assert (c.num_key_value_heads, c.intermediate_size, c.vocab_size) == (8, 14336, 128256)
    assert c.max_position_embeddings == 131072 and c.rms_norm_eps == 1e-5
    assert c.dtype == torch.bfloat16 and not c.tie_word_embeddings
    assert c.rope_parameters == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert _hf_param_count(c) == LLAMA_8B_PARAMS


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, vocab_size=300),
        LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=301,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
        ),
        AutoConfig.for_model(
            "mistral", hidden_size=64, intermediate_size=96, num_key_value_heads=2
        ),
        AutoConfig.for_model(
            "qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=500
        ),
        AutoConfig.for_model(
            "qwen3",
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=500,
            attention_bias=True,
        ),
    ],
    ids=["llama", "llama_tied_biases", "mistral", "qwen2", "qwen3"],
)
def test_weight_params_match_transformers(config: PretrainedConfig) -> None:
    """weight_params = every parameter but the embedding table, with the lm_head counted in full
    (a tied lm_head is the embedding table itself)."""
    embedding = config.vocab_size * config.hidden_size
    table_not_read = 0 if config.tie_word_embeddings else embedding
    assert common.weight_params(config) == _hf_param_count(config) - table_not_read


def test_llama_8b_decode_step_bytes_and_flops() -> None:
    c = _llama_8b()
    weights = common.weight_params(c)
    assert weights == LLAMA_8B_PARAMS - LLAMA_8B_EMBEDDING
    # All weights in bf16, lm_head included: the 16.06 GB checkpoint.
    assert (weights + LLAMA_8B_EMBEDDING) * 2 == 16_060_522_496
    kv_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16
    assert common.kv_bytes_per_token(c, 2) == kv_token == 131072
    # Batch 1, 256 tokens of context (128-token prompt + half of 256 new tokens on average):
    # weights read once (15.01 GB) + one embedding row + 256 tokens of KV read + 1 written.
    step = common.decode_step_bytes(c, 1, 256, 2)
    assert step == weights * 2 + 4096 * 2 + 256 * kv_token + kv_token == 15_043_543_040
    assert round(step / 1e9, 1) == 15.0
    # 4.29 TB/s device copy (read + write): batch 1 cannot beat ~285 tok/s.
    assert common.roofline_tok_s(1, step, 1.0, 4.29e12, 1e15) == pytest.approx(285.2, abs=0.1)
    # KV grows with batch and context; weights do not.
    assert common.decode_step_bytes(c, 64, 256, 2) - step == 63 * (4096 * 2 + 257 * kv_token)

    flops = common.decode_step_flops(c, 1, 256)
    attention = 32 * 4 * 32 * 128 * 256  # layers x (q.k + p.v, 2 FLOPs per MAC) x heads x dim x ctx
    assert flops == 2 * weights + attention == 15_144_067_072
    assert common.decode_step_flops(c, 8, 256) == 8 * flops


def test_roofline_takes_the_slower_bound() -> None:
    # Memory: 1e9 B / 1e12 B/s = 1 ms; compute: 1e12 FLOP / 1e14 FLOP/s = 10 ms -> compute-bound.
    assert common.roofline_tok_s(64, 1e9, 1e12, 1e12, 1e14) == pytest.approx(64 / 10e-3)
    # Same bytes, 10x fewer FLOPs -> memory-bound at 1 ms per step.
    assert common.roofline_tok_s(64, 1e9, 1e11, 1e12, 1e14) == pytest.approx(64 / 1e-3)


def test_unknown_family_has_no_cost_model() -> None:
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*accepted: llama"):
        common.weight_params(AutoConfig.for_model("gpt2"))


def test_device_ceilings_need_cuda() -> None:
    """Without CUDA the ceilings are None (benchmarks then report no roofline)."""
    bw = common.measure_copy_bandwidth(num_bytes=1 << 20, repeats=2)
    rate = common.measure_bf16_matmul_rate(n=256, repeats=2)
    if torch.cuda.is_available():
        assert bw is not None and bw > 0 and rate is not None and rate > 0
    else:
        assert bw is None and rate is None


# ---- metadata, result files, parsing -----------------------------------------------------------


def test_write_result_to_results_and_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    payload = {"gpu": "NVIDIA H200", "points": [{"batch_size": 1}]}
    path = common.write_result("decode", payload, tmp_path / "results")
    assert path.parent == tmp_path / "results"
    assert re.fullmatch(r"decode-nvidia-h200-\d{8}-\d{6}\.json", path.name)
    assert (out / path.name).read_text() == path.read_text()
    data = json.loads(path.read_text())
    assert data["points"] == [{"batch_size": 1}] and data["gpu"] == "NVIDIA H200"
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", data["commit"])
    assert data["date"].endswith("+00:00") and "pytest" in data["command"]
    assert data["versions"]["torch"] == torch.__version__


def test_gpu_name() -> None:
    assert common.gpu_name(torch.device("cpu")) == "cpu"
    assert common.gpu_name() == (
        torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    )


def test_int_list() -> None:
    assert common.int_list("1,8, 32") == [1, 8, 32]
    for bad in ("", "0,1", "a"):
        with pytest.raises(argparse.ArgumentTypeError, match="accepted: comma-separated positive"):
            common.int_list(bad)


def test_kernel_activity_union_and_span() -> None:
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    events: list[dict[str, Any]] = [
        {"ph": "X", "cat": "kernel", "ts": 100.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "ts": 105.0, "dur": 10.0},  # overlaps the first
        {"ph": "X", "cat": "kernel", "ts": 130.0, "dur": 20.0},
        {"ph": "X", "cat": "cuda_runtime", "ts": 90.0, "dur": 100.0},  # host side: ignored
        {"ph": "X", "cat": "gpu_memcpy", "ts": 150.0, "dur": 50.0},  # not a kernel
    ]
    kernels, busy, span = kernel_activity(events) or (0, 0.0, 0.0)
    assert (kernels, busy, span) == (3, 35.0, 50.0)  # idle 30%
    assert kernel_activity(events[3:]) is None


def test_sharegpt_like_lengths() -> None:
    lengths = sharegpt_like_lengths(1000, seed=0)
    assert lengths == sharegpt_like_lengths(1000, seed=0) != sharegpt_like_lengths(1000, seed=1)
    assert all(MIN_LEN <= i <= MAX_LEN and MIN_LEN <= o <= MAX_LEN for i, o in lengths)
    assert 200 < sum(i for i, _ in lengths) / 1000 < 240
    assert 175 < sum(o for _, o in lengths) / 1000 < 205


# ---- smoke runs on a tiny random Llama ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A config-only Llama directory: weights are drawn at load (load_format dummy)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
    ).save_pretrained(d)
    return str(d)


def _tiny_args(tiny_dir: str) -> EngineArgs:
    return EngineArgs(
        model=tiny_dir,
        device="cpu",
        load_format="dummy",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=4 << 20,
    )


def _cpu_flags(tiny_dir: str) -> list[str]:
    return ["--model", tiny_dir, "--device", "cpu", "--kv-cache-memory-bytes", str(4 << 20)]


def _only_result(results: Path, name: str) -> dict[str, Any]:
    (path,) = results.glob(f"{name}-cpu-*.json")
    return json.loads(path.read_text())


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    return tmp_path


def test_bench_decode_smoke(
    tiny_dir: str, results: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = shlex.split(
        "--batch-sizes 1,3 --input-len 8 --output-len 5 --peer hf --peer-batch-sizes 3"
    )
    assert bench_decode.main([*argv, *_cpu_flags(tiny_dir)]) == 0
    data = _only_result(results, "decode")
    engine_args = data["engine_args"]
    assert engine_args["load_format"] == "dummy" and engine_args["skip_tokenizer_init"]
    assert data["copy_bandwidth_bytes_per_s"] is None  # no CUDA: no roofline
    one, three = data["points"]
    assert (one["batch_size"], three["batch_size"]) == (1, 3)
    # Prefill finishes in one step for both: the window holds output_len - 1 tokens per request.
    assert one["decode_tokens"] == 4 and three["decode_tokens"] == 12
    assert one["decode_steps"] == three["decode_steps"] == 4
    for p in (one, three):
        assert p["decode_tok_s"] > 0 and p["roofline_tok_s"] is None and p["gpu"] == "cpu"
        assert p["step_bytes"] > 0 and p["step_flops"] > 0 and "device" in p["engine_args"]
    assert one["peer_tok_s"] is None and three["peer_tok_s"] > 0
    assert three["speedup_vs_peer"] == pytest.approx(three["decode_tok_s"] / three["peer_tok_s"])
    assert [p["batch_size"] for p in data["peer"]["points"]] == [3]
    table = capsys.readouterr().out.strip().splitlines()
    header = " ".join(table[-4].split())
    assert header == "batch tok/s roofline tok/s % roofline peer tok/s speedup"
    assert table[-1].split()[0] == "3"


def test_bench_decode_rejects_peer_sizes_not_measured(tiny_dir: str) -> None:
    args = _tiny_args(tiny_dir)
    with pytest.raises(ValueError, match=r"peer batch sizes \[64\] are not among"):
        bench_decode.run(args, [1], 8, 4, peer="hf", peer_batch_sizes=[64])


def test_bench_offline_smoke(tiny_dir: str, results: Path) -> None:
    argv = shlex.split("--num-prompts 10 --input-mean 12 --output-mean 6 --warmup-prompts 2")
    assert bench_offline.main([*argv, *_cpu_flags(tiny_dir)]) == 0
    (p,) = _only_result(results, "offline")["points"]
    lengths = sharegpt_like_lengths(10, 0, 12, 6)
    assert p["num_requests"] == 10 and p["gpu"] == "cpu"
    assert p["input_tokens"] == sum(i for i, _ in lengths)
    assert p["output_tokens"] == sum(o for _, o in lengths)  # EOS ignored: every drawn length
    assert p["output_tok_s"] == pytest.approx(p["output_tokens"] / p["elapsed_s"])
    assert p["total_tok_s"] == pytest.approx(
        (p["input_tokens"] + p["output_tokens"]) / p["elapsed_s"]
    )


def test_bench_overhead_smoke(tiny_dir: str, results: Path) -> None:
    argv = shlex.split("--batch-size 3 --input-len 8 --warmup-steps 1 --steps 4 --profile-steps 2")
    assert bench_overhead.main([*argv, *_cpu_flags(tiny_dir)]) == 0
    (p,) = _only_result(results, "overhead")["points"]
    assert p["batch_size"] == 3 and p["timed_steps"] == 4
    # On the CPU nothing waits for a device: host time is the whole step.
    assert p["wait_us_per_step"] == 0
    assert p["host_us_per_step"] == pytest.approx(p["step_wall_us"]["mean"])
    assert 0 < p["launch_us_per_step"] < p["host_us_per_step"]
    assert p["gpu_idle_fraction"] is None and p["gpu_profile"] is None


def test_host_clock_restores_what_it_wraps(tiny_dir: str) -> None:
    args = _tiny_args(tiny_dir)
    engine = LLMEngine.from_engine_args(args)
    originals = (
        torch.cuda.Event.synchronize,
        torch.cuda.Stream.synchronize,
        torch.cuda.synchronize,
    )
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    with host_clock(engine) as clock:
        assert torch.cuda.synchronize is not originals[2]
        while engine.has_unfinished_requests():
            engine.step()
    assert clock.execute_s > 0 and clock.wait_s == 0
    assert (
        torch.cuda.Event.synchronize,
        torch.cuda.Stream.synchronize,
        torch.cuda.synchronize,
    ) == originals
    assert "execute" not in vars(engine.runner)
