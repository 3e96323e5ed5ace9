"""Offline throughput: many requests with ShareGPT-like lengths, all queued at once.

Lengths are seeded draws: input and output each lognormal with the given mean (ShareGPT with a
Llama tokenizer: ~220 prompt and ~190 output tokens) and sigma (the spread of log-length), rounded
and clipped to [4, 2048]. Prompts are random token ids; outputs run to their drawn length (EOS
ignored). Wall time runs from queuing the first request to the last one finishing:
total_tok_s = (prompt + output tokens) / wall, output_tok_s = output tokens / wall.

    python -m benchmarks.bench_offline
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

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

# Shortest and longest prompt or output drawn, in tokens.
MIN_LEN, MAX_LEN = 4, 2048


@dataclasses.dataclass(frozen=True)
class OfflineRun:
    num_requests: int
    input_tokens: int
    output_tokens: int
    steps: int
    elapsed_s: float

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def sharegpt_like_lengths(
    count: int,
    seed: int,
    input_mean: float = 220.0,
    output_mean: float = 190.0,
    input_sigma: float = 1.0,
    output_sigma: float = 1.0,
) -> list[tuple[int, int]]:
    """`count` seeded (prompt, output) lengths in tokens, each lognormal with the given mean
    (before clipping) and sigma, clipped to [MIN_LEN, MAX_LEN]."""
    rng = random.Random(seed)

    def draw(mean: float, sigma: float) -> int:
        # A lognormal's mean is exp(mu + sigma^2 / 2).
        value = rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)
        return min(MAX_LEN, max(MIN_LEN, round(value)))

    return [(draw(input_mean, input_sigma), draw(output_mean, output_sigma)) for _ in range(count)]


def run_requests(engine: LLMEngine, requests: list[tuple[list[int], int]], tag: str) -> OfflineRun:
    """Queue every (prompt, output length) at once and step until all finish."""
    device = engine.config.device
    synchronize(device)
    t0 = time.perf_counter()
    for i, (prompt, output_len) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params)
    output_tokens = steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                output_tokens += len(out.outputs[0].token_ids)
        steps += 1
    synchronize(device)
    elapsed = time.perf_counter() - t0
    input_tokens = sum(len(p) for p, _ in requests)
    return OfflineRun(len(requests), input_tokens, output_tokens, steps, elapsed)


def run(
    engine_args: EngineArgs,
    num_prompts: int = 1000,
    data_seed: int = 0,
    input_mean: float = 220.0,
    output_mean: float = 190.0,
    input_sigma: float = 1.0,
    output_sigma: float = 1.0,
    warmup_prompts: int = 16,
) -> dict[str, Any]:
    config = engine_args.create_engine_config()
    lengths = sharegpt_like_lengths(
        num_prompts, data_seed, input_mean, output_mean, input_sigma, output_sigma
    )
    longest = max(i + o for i, o in lengths)
    if longest > config.scheduler.max_model_len:
        raise ValueError(
            f"a drawn request needs {longest} tokens, above max_model_len="
            f"{config.scheduler.max_model_len}; accepted: --max-model-len >= {longest}"
        )
    engine = LLMEngine(config)
    vocab = config.model.vocab_size
    rng = random.Random(data_seed)

    def prompts(shape: list[tuple[int, int]]) -> list[tuple[list[int], int]]:
        return [([rng.randrange(vocab) for _ in range(i)], o) for i, o in shape]

    # Warm-up (JIT compilation, allocator): a few requests of the same kind, 16 tokens out at most.
    warm = sharegpt_like_lengths(
        warmup_prompts, data_seed + 1, input_mean, output_mean, input_sigma, output_sigma
    )
    run_requests(engine, prompts([(i, min(o, 16)) for i, o in warm]), "warmup")
    r = run_requests(engine, prompts(lengths), "offline")
    gpu = gpu_name(config.device)
    point = {
        # The batch cap: offline runs as many requests at once as fit in it.
        "batch_size": config.scheduler.max_num_seqs,
        "output_tok_s": r.output_tok_s,
        "total_tok_s": r.total_tok_s,
        "requests_per_s": r.num_requests / r.elapsed_s,
        "roofline_tok_s": None,
        "peer_tok_s": None,
        "num_requests": r.num_requests,
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens,
        "mean_input_len": statistics.fmean(i for i, _ in lengths),
        "mean_output_len": statistics.fmean(o for _, o in lengths),
        "steps": r.steps,
        "elapsed_s": r.elapsed_s,
        "gpu": gpu,
        "engine_args": engine_options(engine_args),
    }
    return {
        "gpu": gpu,
        "benchmark": "offline",
        "model": engine_args.model,
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "lengths": {
            "distribution": "lognormal, clipped",
            "input_mean": input_mean,
            "output_mean": output_mean,
            "input_sigma": input_sigma,
            "output_sigma": output_sigma,
            "min": MIN_LEN,
            "max": MAX_LEN,
            "seed": data_seed,
        },
        "warmup_prompts": warmup_prompts,
        "engine_args": engine_options(engine_args),
        "points": [point],
    }


def table(payload: dict[str, Any]) -> str:
    headers = ["requests", "in tok", "out tok", "wall s", "req/s", "total tok/s", "output tok/s"]
    rows = [
        [
            str(p["num_requests"]),
            str(p["input_tokens"]),
            str(p["output_tokens"]),
            fmt(p["elapsed_s"], 2),
            fmt(p["requests_per_s"], 2),
            fmt(p["total_tok_s"]),
            fmt(p["output_tok_s"]),
        ]
        for p in payload["points"]
    ]
    return format_table(headers, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-mean", type=float, default=220.0, help="mean prompt tokens")
    parser.add_argument("--output-mean", type=float, default=190.0, help="mean output tokens")
    parser.add_argument("--input-sigma", type=float, default=1.0, help="sigma of log prompt len")
    parser.add_argument("--output-sigma", type=float, default=1.0, help="sigma of log output len")
    parser.add_argument("--warmup-prompts", type=int, default=16, help="untimed requests first")
    parser.add_argument("--data-seed", type=int, default=0, help="seeds lengths and prompts")
    add_engine_cli(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    payload = run(
        EngineArgs.from_cli_args(ns),
        ns.num_prompts,
        ns.data_seed,
        ns.input_mean,
        ns.output_mean,
        ns.input_sigma,
        ns.output_sigma,
        ns.warmup_prompts,
    )
    path = write_result("offline", payload)
    print(f"wrote {path}")
    print(table(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
