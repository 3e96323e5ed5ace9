"""Host overhead in steady decode: host microseconds per engine step, and the fraction of time the
GPU sits idle between decode steps.

A step is schedule -> runner.execute (prepare inputs, launch or replay) -> process the results of
the step that finished (the previous one under asynchronous scheduling). The only place the host
should wait for the device is the synchronize on the event of the step it processes. So, with the
engine unprofiled:
  host_us  = step() wall time - time inside torch.cuda Event/Stream/device synchronize calls
  launch_us = the part of host_us spent inside runner.execute (input preparation + launches)
  other_us  = host_us - launch_us (scheduling, output processing, the engine's bookkeeping)
A hidden sync (.item(), .tolist() of a device tensor) is counted as host time: the figure errs high.

GPU idle comes from a separate torch.profiler run recording CUDA activity only (no CPU ops, so the
host is not slowed): busy = the union of kernel intervals, span = first kernel start to last kernel
end over the profiled steps, idle = 1 - busy / span.

    python -m benchmarks.bench_overhead
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile, schedule

if not __package__:  # run as a file (python benchmarks/x.py): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    add_engine_cli,
    engine_options,
    fmt,
    format_table,
    gpu_name,
    synchronize,
    write_result,
)
from nostall.engine.args import EngineArgs
from nostall.engine.llm_engine import LLMEngine
from nostall.sampling_params import SamplingParams

# Profiler steps before the recorded ones: skipped, then tracing without recording (CUPTI start-up).
_PROFILE_WAIT, _PROFILE_WARMUP = 1, 2


@dataclasses.dataclass
class HostClock:
    """Seconds spent, while installed, waiting for the device and inside runner.execute."""

    wait_s: float = 0.0
    # runner.execute time, the waits inside it excluded.
    execute_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepTimes:
    wall_s: float
    wait_s: float
    execute_s: float

    @property
    def host_s(self) -> float:
        return self.wall_s - self.wait_s


@contextlib.contextmanager
def host_clock(engine: LLMEngine) -> Iterator[HostClock]:
    """Wrap the device waits (torch.cuda Event/Stream/device synchronize) and the engine's
    runner.execute so that their time accumulates in the yielded clock; restored on exit."""
    clock = HostClock()

    def waiting(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.wait_s += time.perf_counter() - t0

        return wrapper

    execute = engine.runner.execute

    @functools.wraps(execute)
    def timed_execute(*args: Any, **kwargs: Any) -> Any:
        w0, t0 = clock.wait_s, time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            clock.execute_s += time.perf_counter() - t0 - (clock.wait_s - w0)

    with contextlib.ExitStack() as stack:
        for owner in (torch.cuda.Event, torch.cuda.Stream, torch.cuda):
            stack.enter_context(mock.patch.object(owner, "synchronize", waiting(owner.synchronize)))
        stack.enter_context(mock.patch.object(engine.runner, "execute", timed_execute))
        yield clock


def time_steps(engine: LLMEngine, num_steps: int) -> list[StepTimes]:
    times: list[StepTimes] = []
    with host_clock(engine) as clock:
        for _ in range(num_steps):
            w0, e0 = clock.wait_s, clock.execute_s
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            times.append(StepTimes(wall, clock.wait_s - w0, clock.execute_s - e0))
    return times


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def kernel_activity(trace_events: list[dict[str, Any]]) -> tuple[int, float, float] | None:
    """(kernels, busy µs, span µs) of a Chrome trace's kernel events: busy is the union of their
    intervals, span runs from the first start to the last end. None when there are no kernels."""
    intervals = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in trace_events
        if e.get("cat") == "kernel" and e.get("ph") == "X"
    ]
    if not intervals:
        return None
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    return len(intervals), union_length(intervals), span


def profile_gpu_idle(engine: LLMEngine, num_steps: int) -> dict[str, float] | None:
    """GPU busy/idle over `num_steps` steady steps from a CUDA-only torch.profiler trace; None off
    CUDA."""
    if engine.config.device.type != "cuda":
        return None
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = Path(tmp) / "trace.json"
        with profile(
            activities=[ProfilerActivity.CUDA],
            schedule=schedule(
                wait=_PROFILE_WAIT, warmup=_PROFILE_WARMUP, active=num_steps, repeat=1
            ),
            on_trace_ready=lambda p: p.export_chrome_trace(str(trace_file)),
        ) as prof:
            for i in range(_PROFILE_WAIT + _PROFILE_WARMUP + num_steps):
                engine.step()
                if i == _PROFILE_WAIT + _PROFILE_WARMUP + num_steps - 1:
                    # Let the last recorded step's kernels finish inside the trace.
                    synchronize(engine.config.device)
                prof.step()
        trace = json.loads(trace_file.read_text())
    activity = kernel_activity(trace.get("traceEvents", []))
    if activity is None:
        return None
    kernels, busy_us, span_us = activity
    return {
        "gpu_idle_fraction": 1.0 - busy_us / span_us,
        "gpu_busy_us_per_step": busy_us / num_steps,
        "gpu_span_us_per_step": span_us / num_steps,
        "kernels_per_step": kernels / num_steps,
        "profiled_steps": num_steps,
    }


def _stats_us(values_s: list[float]) -> dict[str, float]:
    ordered = sorted(values_s)
    return {
        "mean": 1e6 * statistics.fmean(ordered),
        "median": 1e6 * statistics.median(ordered),
        "p90": 1e6 * ordered[int(0.9 * (len(ordered) - 1))],
    }


def run(
    engine_args: EngineArgs,
    batch_size: int = 64,
    input_len: int = 128,
    warmup_steps: int = 20,
    steps: int = 200,
    profile_steps: int = 50,
    data_seed: int = 0,
) -> dict[str, Any]:
    """Steady decode of `batch_size` requests: time `steps` steps, then profile `profile_steps`."""
    config = engine_args.create_engine_config()
    # Enough tokens that no request finishes (and the batch stays whole) while measuring.
    output_len = warmup_steps + steps + _PROFILE_WAIT + _PROFILE_WARMUP + profile_steps + 8
    if batch_size > config.scheduler.max_num_seqs:
        raise ValueError(
            f"batch_size={batch_size} exceeds max_num_seqs={config.scheduler.max_num_seqs};"
            " accepted: at most --max-num-seqs"
        )
    if input_len + output_len > config.scheduler.max_model_len:
        raise ValueError(
            f"input_len + steps need {input_len + output_len} tokens, above max_model_len="
            f"{config.scheduler.max_model_len}; accepted: fewer steps or a longer --max-model-len"
        )
    engine = LLMEngine(config)
    rng = random.Random(data_seed)
    vocab = config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(
            f"overhead-{i}", [rng.randrange(vocab) for _ in range(input_len)], params
        )
    started: set[str] = set()
    while len(started) < batch_size:  # prefill: until every request has its first token
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(warmup_steps):
        engine.step()
    synchronize(config.device)
    times = time_steps(engine, steps)
    gpu_profile = profile_gpu_idle(engine, profile_steps)
    gpu = gpu_name(config.device)

    wall = statistics.fmean(t.wall_s for t in times)
    host = _stats_us([t.host_s for t in times])
    point = {
        "batch_size": batch_size,
        "decode_tok_s": batch_size / wall,
        "roofline_tok_s": None,
        "peer_tok_s": None,
        "host_us_per_step": host["mean"],
        "host_us": host,
        "launch_us_per_step": 1e6 * statistics.fmean(t.execute_s for t in times),
        "other_host_us_per_step": 1e6 * statistics.fmean(t.host_s - t.execute_s for t in times),
        "wait_us_per_step": 1e6 * statistics.fmean(t.wait_s for t in times),
        "step_wall_us": _stats_us([t.wall_s for t in times]),
        "timed_steps": steps,
        "gpu_idle_fraction": None if gpu_profile is None else gpu_profile["gpu_idle_fraction"],
        "gpu_profile": gpu_profile,
        "gpu": gpu,
        "engine_args": engine_options(engine_args),
    }
    return {
        "gpu": gpu,
        "benchmark": "overhead",
        "model": engine_args.model,
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "input_len": input_len,
        "warmup_steps": warmup_steps,
        "engine_args": engine_options(engine_args),
        "points": [point],
    }


def table(payload: dict[str, Any]) -> str:
    headers = ["batch", "step us", "host us", "launch us", "other us", "wait us", "GPU idle %"]
    rows = []
    for p in payload["points"]:
        idle = p["gpu_idle_fraction"]
        rows.append(
            [
                str(p["batch_size"]),
                fmt(p["step_wall_us"]["mean"]),
                fmt(p["host_us_per_step"]),
                fmt(p["launch_us_per_step"]),
                fmt(p["other_host_us_per_step"]),
                fmt(p["wait_us_per_step"]),
                fmt(None if idle is None else 100 * idle, 2),
            ]
        )
    return format_table(headers, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--warmup-steps", type=int, default=20, help="untimed decode steps first")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps (unprofiled)")
    parser.add_argument(
        "--profile-steps", type=int, default=50, help="decode steps recorded by the profiler"
    )
    parser.add_argument("--data-seed", type=int, default=0, help="seeds the random prompts")
    add_engine_cli(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    payload = run(
        EngineArgs.from_cli_args(ns),
        ns.batch_size,
        ns.input_len,
        ns.warmup_steps,
        ns.steps,
        ns.profile_steps,
        ns.data_seed,
    )
    path = write_result("overhead", payload)
    print(f"wrote {path}")
    print(table(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
