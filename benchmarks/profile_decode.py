"""Where one steady decode step spends its device time: kernels by total time per step.

    python -m benchmarks.profile_decode --batch-size 1

Prints the top kernels (time per step, share of the step), the sum of kernel time per step, the
wall time per step and the gap between them (launch gaps inside and between graph replays).
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import add_engine_cli, write_result
from nostall.engine.args import EngineArgs
from nostall.engine.llm_engine import LLMEngine
from nostall.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_cli(parser)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    ns = parser.parse_args(argv)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    rng = random.Random(0)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(ns.batch_size):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(ns.input_len)], params)
    for _ in range(30):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(ns.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / ns.steps
    per_kernel: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    intervals = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.elapsed_us() > 0:
            per_kernel[ev.name] += ev.time_range.elapsed_us()
            counts[ev.name] += 1
            intervals.append((ev.time_range.start, ev.time_range.end))
    busy = sum(per_kernel.values()) / ns.steps
    intervals.sort()
    span = (intervals[-1][1] - intervals[0][0]) / ns.steps if intervals else 0.0
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1])[: ns.top]
    print(
        f"batch {ns.batch_size}: wall {wall * 1e6:.0f} us/step, kernels {busy:.0f} us/step, span {span:.0f} us/step"
    )
    print(f"{'us/step':>9} {'share':>6} {'calls/step':>10}  kernel")
    for name, total in rows:
        print(
            f"{total / ns.steps:9.1f} {100 * total / ns.steps / busy:5.1f}% {counts[name] / ns.steps:10.1f}  {name[:110]}"
        )
    write_result(
        "profile-decode",
        {
            "batch_size": ns.batch_size,
            "wall_us_per_step": wall * 1e6,
            "kernel_us_per_step": busy,
            "span_us_per_step": span,
            "kernels": [
                {"name": n, "us_per_step": t / ns.steps, "calls_per_step": counts[n] / ns.steps}
                for n, t in rows
            ],
        },
    )


if __name__ == "__main__":
    main()
