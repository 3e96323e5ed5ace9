"""What every benchmark shares: the engine CLI, run metadata and result files, the device's measured
ceilings (copy bandwidth, bf16 matmul rate), and the cost model of one decode step the roofline is
built from.

Units: bytes, FLOPs, seconds, bytes/s and FLOP/s throughout, unless a name says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from nostall.engine.args import EngineArgs

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
# Llama-3.1-8B's shape, config only: benchmarks draw random weights on the device.
LLAMA_8B_DIR = BENCH_DIR / "configs" / "llama-3.1-8b"

# Model families whose decoder layer is attention (q, k, v, o) + gated MLP (gate, up, down) + two
# RMSNorms: the layout `weight_params` counts.
_DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


# ---- command line -------------------------------------------------------------------------


def add_engine_cli(parser: argparse.ArgumentParser) -> None:
    """--model plus every engine flag of EngineArgs, so new engine options pass straight through.

    Benchmarks default to random weights (a config-only directory) and token-id prompts."""
    parser.add_argument(
        "--model",
        default=str(LLAMA_8B_DIR),
        help="model directory (default: the Llama-3.1-8B shape, config only)",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(load_format="dummy", skip_tokenizer_init=True)


def int_list(text: str) -> list[int]:
    """argparse type for "1,8,32": positive integers, comma-separated."""
    error = f"{text!r} is invalid; accepted: comma-separated positive integers, e.g. 1,8,32"
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(error) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(error)
    return values


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, where work is synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = [
        "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


# ---- run metadata and result files ----------------------------------------------------------


def gpu_name(device: torch.device | None = None) -> str:
    """The name of `device` (default: the current CUDA device, if any), or "cpu" for the CPU."""
    if device is None:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def git_commit() -> str:
    """HEAD's hash, "-dirty" when tracked files differ from it.

    A checkout without .git (e.g. a copied working tree) reports $NOSTALL_COMMIT, else "unknown"."""
    if not (REPO_ROOT / ".git").exists():
        return os.environ.get("NOSTALL_COMMIT", "unknown")
    try:
        head = _git("rev-parse", "HEAD")
        # No optional locks: never contend with a git command running beside the benchmark.
        changes = _git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("NOSTALL_COMMIT", "unknown")
    return head + ("-dirty" if changes else "")


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=30
    )
    return done.stdout.strip()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_metadata() -> dict[str, Any]:
    return {
        "gpu": gpu_name(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": _version("transformers"),
            "triton": _version("triton"),
        },
    }


def write_result(name: str, payload: dict[str, Any], results_dir: Path | None = None) -> Path:
    """Write run metadata + payload to <results_dir>/<name>-<gpu-slug>-<YYYYMMDD-HHMMSS>.json (UTC)
    and, when $OUT is set, a copy of the same name into $OUT. Returns the first file's path.

    A "gpu" in the payload (the device the benchmark ran on) overrides the machine's."""
    record = {**run_metadata(), **payload}
    slug = re.sub(r"[^a-z0-9]+", "-", record["gpu"].lower()).strip("-")
    stamp = datetime.datetime.fromisoformat(record["date"]).strftime("%Y%m%d-%H%M%S")
    file_name = f"{name}-{slug}-{stamp}.json"
    text = json.dumps(record, indent=2, default=str) + "\n"
    targets = [(results_dir or RESULTS_DIR) / file_name]
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / file_name)
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return targets[0]


def engine_options(args: EngineArgs) -> dict[str, Any]:
    return dataclasses.asdict(args)


# ---- device ceilings (CUDA only: None elsewhere) -------------------------------------------


def _median_cuda_seconds(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in ms
    return statistics.median(times)


def measure_copy_bandwidth(num_bytes: int = 2 << 30, repeats: int = 20) -> float | None:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written, median over
    `repeats` copies of a `num_bytes` buffer (default 2 GiB, far beyond every cache). None without
    CUDA."""
    if not torch.cuda.is_available():
        return None
    src = torch.ones(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _median_cuda_seconds(functools.partial(dst.copy_, src), repeats)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / seconds


def measure_bf16_matmul_rate(n: int = 8192, repeats: int = 20) -> float | None:
    """bf16 matmul rate in FLOP/s: an n x n x n product of random matrices (2 n^3 FLOPs), median
    over `repeats`. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    seconds = _median_cuda_seconds(functools.partial(torch.mm, a, b, out=out), repeats)
    del a, b, out
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds


# ---- the cost of one decode step --------------------------------------------------------------


def _head_dim(hf_config: Any) -> int:
    hd = getattr(hf_config, "head_dim", None)
    return int(hd or hf_config.hidden_size // hf_config.num_attention_heads)


def _num_kv_heads(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def weight_params(hf_config: Any) -> int:
    """Parameters one decode step reads in full: every decoder layer, the final norm, and the
    lm_head (vocab x hidden, read in full even when tied to the embedding). The embedding table is
    left out: a step reads only its looked-up rows (counted in `decode_step_bytes`)."""
    family = hf_config.model_type
    if family not in _DENSE_FAMILIES:
        raise ValueError(
            f"model_type={family!r} has no cost model; accepted: {', '.join(_DENSE_FAMILIES)}"
        )
    h, inter = int(hf_config.hidden_size), int(hf_config.intermediate_size)
    hd = _head_dim(hf_config)
    q, kv = int(hf_config.num_attention_heads) * hd, _num_kv_heads(hf_config) * hd
    attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections
    if family == "qwen2":
        attention += q + 2 * kv  # q, k, v biases
    elif getattr(hf_config, "attention_bias", False):
        attention += q + 2 * kv + h  # q, k, v, o biases
    if family == "qwen3":
        attention += 2 * hd  # per-head q and k RMSNorms
    mlp = 3 * h * inter + (2 * inter + h if getattr(hf_config, "mlp_bias", False) else 0)
    layer = attention + mlp + 2 * h  # + input and post-attention RMSNorms
    lm_head = int(hf_config.vocab_size) * h
    return int(hf_config.num_hidden_layers) * layer + h + lm_head


def kv_bytes_per_token(hf_config: Any, dtype_bytes: int) -> int:
    """K and V of one token in every layer."""
    layers = int(hf_config.num_hidden_layers)
    return 2 * layers * _num_kv_heads(hf_config) * _head_dim(hf_config) * dtype_bytes


def decode_step_bytes(hf_config: Any, batch: int, context_len: int, dtype_bytes: int) -> int:
    """HBM bytes one decode step must move, for `batch` requests each attending to `context_len`
    tokens (its new token included): every weight read once (`weight_params`), one embedding row
    per request, the K/V of all `context_len` tokens of every request read, and the new token's
    K/V written. Activations, logits and sampling state are left out (negligible at batch 1; for
    the 8B shape at most ~2.5 GB at batch 256, if none stayed in L2), so the bound is a little
    optimistic at large batches. Attention is taken as full (a sliding window only lowers the KV
    read once context_len exceeds it)."""
    weights = weight_params(hf_config) * dtype_bytes
    embedding_rows = batch * int(hf_config.hidden_size) * dtype_bytes
    kv = kv_bytes_per_token(hf_config, dtype_bytes)
    return weights + embedding_rows + batch * context_len * kv + batch * kv


def decode_step_flops(hf_config: Any, batch: int, context_len: int) -> int:
    """FLOPs of one decode step: 2 x `weight_params` x batch for the matrix products (norm weights
    counted as if they were, < 0.01%), plus attention: q.k and p.v over `context_len` tokens,
    2 FLOPs per multiply-add, per query head and layer."""
    matmul = 2 * weight_params(hf_config) * batch
    per_token_layer = 4 * int(hf_config.num_attention_heads) * _head_dim(hf_config) * context_len
    return matmul + batch * int(hf_config.num_hidden_layers) * per_token_layer


def roofline_tok_s(
    batch: int, step_bytes: float, step_flops: float, bw: float, rate: float
) -> float:
    """Decode tokens/s no engine can beat: a step takes at least max(bytes / bandwidth,
    FLOPs / matmul rate) seconds and yields one token per request."""
    return batch / max(step_bytes / bw, step_flops / rate)
