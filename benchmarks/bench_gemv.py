"""Decode linear layers: the Triton skinny GEMM (every config of a sweep, and its default pick)
against torch.nn.functional.linear (cuBLAS), on Llama-3.1-8B's projections, bf16.

Per (M, shape): y[M, N] = x[M, K] @ W[N, K]^T without bias, time = median of
triton.testing.do_bench (which also flushes L2 before each call); besides, each call reads the next
of several copies of W, enough that together they span >= 3x the H200's 60 MB L2, so no call finds
its weights cached. GB/s counts W's bytes only (x and y are < 0.1% of them at M <= 8); % copy is
that rate over the device's measured copy bandwidth (read + write). M = 64 is there to show where
cuBLAS should win. Every config's output is checked against torch's (relative error <= 2e-2); a
config that fails to compile or to match is reported and left out of the ranking.

    python -m benchmarks.bench_gemv      (about a minute on the H200; JSON to benchmarks/results/)
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python benchmarks/x.py): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
import triton.testing

from benchmarks.common import fmt, format_table, measure_copy_bandwidth, write_result
from nostall.kernels.triton.skinny_gemm import (
    SkinnyConfig,
    default_config,
    num_sms,
    skinny_gemm,
)

DTYPE = torch.bfloat16
M_VALUES = (1, 8, 64)
# Llama-3.1-8B's projections (N, K).
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
L2_BYTES = 60 * 2**20
MAX_ERROR = 2e-2
# do_bench windows (ms): short, the sweep runs ~200 timings.
WARMUP_MS, REP_MS = 5, 25


def sweep_configs(m: int) -> list[SkinnyConfig]:
    """The configs tried at M rows (besides the default pick). Sum mode (M <= 8) keeps its float32
    accumulator BLOCK_M * BLOCK_N * BLOCK_K / threads <= 128 per thread; dot mode pads M to >= 16."""
    dot = [
        SkinnyConfig(16, 128, dot=True),
        SkinnyConfig(32, 128, dot=True),
        SkinnyConfig(64, 128, dot=True),
        SkinnyConfig(32, 256, dot=True, num_stages=3),
        SkinnyConfig(64, 256, dot=True, num_stages=3),
        SkinnyConfig(128, 128, dot=True, num_warps=8, num_stages=3),
        SkinnyConfig(64, 128, dot=True, split_k=2),
    ]
    if m == 1:
        return [
            SkinnyConfig(8, 256),
            SkinnyConfig(16, 256),
            SkinnyConfig(32, 256),
            SkinnyConfig(16, 512, num_warps=8, num_stages=3),
            SkinnyConfig(32, 512, num_warps=8, num_stages=1),  # no pipelining: loads to registers
            SkinnyConfig(16, 256, split_k=2),
            *dot,
        ]
    if m <= 8:
        return [
            SkinnyConfig(8, 128),
            SkinnyConfig(16, 128, num_warps=8, num_stages=3),
            SkinnyConfig(8, 256, num_warps=8, num_stages=3),
            *dot,
        ]
    return [c for c in dot if c.num_warps == 4] + [
        SkinnyConfig(128, 64, dot=True, num_stages=4),
        SkinnyConfig(128, 128, dot=True, num_warps=8, num_stages=4),
    ]


def _time_us(fn: Callable[[], torch.Tensor]) -> float:
    return 1e3 * float(
        triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    )


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def bench_shape(m: int, name: str, n: int, k: int, copy_bw: float) -> dict[str, Any]:
    weight_bytes = n * k * DTYPE.itemsize
    copies = max(1, math.ceil(3 * L2_BYTES / weight_bytes))
    weights = [torch.randn(n, k, dtype=DTYPE, device="cuda") * k**-0.5 for _ in range(copies)]
    x = torch.randn(m, k, dtype=DTYPE, device="cuda")
    ref = F.linear(x, weights[0])

    def rotating(op: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        cycle = itertools.cycle(weights)
        return lambda: op(next(cycle))

    def gb_s(us: float) -> float:
        return weight_bytes / (us * 1e-6) / 1e9

    torch_us = _time_us(rotating(lambda w: F.linear(x, w)))
    default = default_config(m, n, k, num_sms(x.device))
    tried: list[dict[str, Any]] = []
    for config in [default, *(c for c in sweep_configs(m) if c != default)]:
        entry: dict[str, Any] = {"config": config.name, "default": config == default}
        try:
            error = _relative_error(skinny_gemm(x, weights[0], config=config), ref)
            if not error <= MAX_ERROR:
                raise AssertionError(f"relative error {error:.3g} > {MAX_ERROR}")
            us = _time_us(rotating(lambda w, config=config: skinny_gemm(x, w, config=config)))
            entry |= {"time_us": us, "gb_s": gb_s(us), "relative_error": error}
        except Exception as exc:  # a config the device cannot run is a result, not a crash
            entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
        tried.append(entry)
    timed = [e for e in tried if "time_us" in e]
    best = min(timed, key=lambda e: e["time_us"]) if timed else None
    default_us = tried[0].get("time_us")
    return {
        "m": m,
        "shape": name,
        "n": n,
        "k": k,
        "weight_bytes": weight_bytes,
        "weight_copies": copies,
        "torch_us": torch_us,
        "torch_gb_s": gb_s(torch_us),
        "triton_default": tried[0]["config"],
        "triton_default_us": default_us,
        "triton_best": None if best is None else best["config"],
        "triton_best_us": None if best is None else best["time_us"],
        "triton_best_gb_s": None if best is None else best["gb_s"],
        "triton_best_pct_copy": None if best is None else 100 * best["gb_s"] * 1e9 / copy_bw,
        "torch_pct_copy": 100 * gb_s(torch_us) * 1e9 / copy_bw,
        "winner": "triton" if best is not None and best["time_us"] < torch_us else "torch",
        "configs": tried,
    }


def summary_table(results: list[dict[str, Any]]) -> str:
    headers = ["M", "shape", "torch us", "torch %copy", "default us", "best us", "best GB/s",
               "best %copy", "best config", "winner", "torch/best"]  # fmt: skip
    rows = [
        [
            str(r["m"]),
            r["shape"],
            fmt(r["torch_us"]),
            fmt(r["torch_pct_copy"]),
            fmt(r["triton_default_us"]),
            fmt(r["triton_best_us"]),
            fmt(r["triton_best_gb_s"], 0),
            fmt(r["triton_best_pct_copy"]),
            r["triton_best"] or "-",
            r["winner"],
            fmt(r["torch_us"] / r["triton_best_us"] if r["triton_best_us"] else None, 2) + "x",
        ]
        for r in results
    ]
    return format_table(headers, rows)


def config_table(results: list[dict[str, Any]], m: int) -> str:
    """Microseconds of every config tried at M rows (one column per shape; * = default pick)."""
    at_m = [r for r in results if r["m"] == m]
    names = list(dict.fromkeys(e["config"] for r in at_m for e in r["configs"]))
    rows = []
    for config in names:
        row = [config]
        for r in at_m:
            entry = next((e for e in r["configs"] if e["config"] == config), None)
            if entry is None:
                row.append("")
            elif "time_us" not in entry:
                row.append("error")
            else:
                row.append(fmt(entry["time_us"]) + ("*" if entry["default"] else ""))
        rows.append(row)
    rows.append(["torch", *(fmt(r["torch_us"]) for r in at_m)])
    return format_table([f"M={m} config (us)", *(r["shape"] for r in at_m)], rows)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA GPU")
    torch.manual_seed(0)
    start = time.perf_counter()
    copy_bw = measure_copy_bandwidth()
    assert copy_bw is not None
    results = [
        bench_shape(m, name, n, k, copy_bw) for m in M_VALUES for name, (n, k) in SHAPES.items()
    ]
    for m in M_VALUES:
        print(config_table(results, m), end="\n\n")
    print(summary_table(results))
    payload = {
        "dtype": str(DTYPE),
        "copy_bandwidth_gb_s": copy_bw / 1e9,
        "num_sms": num_sms(torch.device("cuda")),
        "results": results,
        "wall_s": time.perf_counter() - start,
    }
    path = write_result("gemv", payload)
    print(
        f"\ncopy bandwidth {copy_bw / 1e9:,.0f} GB/s; wall {payload['wall_s']:.0f} s; wrote {path}"
    )


if __name__ == "__main__":
    main()
