"""nostall decode throughput at several batch sizes, next to the roofline and (with --peer hf)
Hugging Face transformers measured in the same run.

Per batch size B: B random prompts of --input-len token ids, --output-len new tokens each, greedy,
EOS ignored, driven through LLMEngine. Steps run until every request has its first token (prefill
done); the remaining steps are timed (device synchronized at both ends):
decode_tok_s = tokens generated in that window / its wall time = B x (output_len - 1) / elapsed
when the whole batch prefills in the same step.

    python -m benchmarks.bench_decode --peer hf
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python benchmarks/x.py): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    add_engine_cli,
    decode_step_bytes,
    decode_step_flops,
    engine_options,
    fmt,
    format_table,
    gpu_name,
    int_list,
    measure_bf16_matmul_rate,
    measure_copy_bandwidth,
    roofline_tok_s,
    synchronize,
    write_result,
)
from benchmarks.peer_hf import add_peer_cli, run_hf_peer
from nostall.engine.args import EngineArgs
from nostall.engine.llm_engine import LLMEngine
from nostall.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    batch_size: int
    decode_tok_s: float
    # Steps and tokens in the timed window (after every request has its first token).
    decode_steps: int
    decode_tokens: int
    elapsed_s: float

    @property
    def mean_step_ms(self) -> float:
        return 1e3 * self.elapsed_s / self.decode_steps


def random_prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def time_decode(
    engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str
) -> DecodeRun:
    """Run `prompts` to `output_len` tokens each and time the decode steps after the prefill."""
    if output_len < 2:
        raise ValueError(f"output_len={output_len} is invalid; accepted: >= 2 (one decode step)")
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    # Request id -> tokens it has so far, as the engine reports them.
    counts: dict[str, int] = {}

    def step() -> None:
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)

    while len(counts) < len(prompts):
        step()
    before = sum(counts.values())
    device = engine.config.device
    synchronize(device)
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        step()
        steps += 1
    synchronize(device)
    elapsed = time.perf_counter() - t0
    tokens = sum(counts.values()) - before
    return DecodeRun(len(prompts), tokens / elapsed, steps, tokens, elapsed)


def run(
    engine_args: EngineArgs,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    warmup_runs: int = 1,
    peer: str | None = None,
    peer_batch_sizes: list[int] | None = None,
    hf_attn_implementation: str = "sdpa",
    data_seed: int = 0,
) -> dict[str, Any]:
    """Measure every batch size; returns the result payload (see the module docstring)."""
    config = engine_args.create_engine_config()
    too_big = [b for b in batch_sizes if b > config.scheduler.max_num_seqs]
    if too_big:
        raise ValueError(
            f"batch sizes {too_big} exceed max_num_seqs={config.scheduler.max_num_seqs}; accepted:"
            " batch sizes up to --max-num-seqs"
        )
    if input_len + output_len > config.scheduler.max_model_len:
        raise ValueError(
            f"input_len + output_len = {input_len + output_len} exceeds max_model_len="
            f"{config.scheduler.max_model_len}; accepted: at most max_model_len"
        )
    peer_sizes: list[int] = (
        [b for b in (1, 64) if b in batch_sizes] if peer_batch_sizes is None else peer_batch_sizes
    )
    missing = sorted(set(peer_sizes) - set(batch_sizes))
    if missing:
        raise ValueError(f"peer batch sizes {missing} are not among the batch sizes {batch_sizes}")

    # Ceilings and the peer first: both need device memory the engine's KV cache later takes.
    on_gpu = config.device.type == "cuda"
    bw = measure_copy_bandwidth() if on_gpu else None
    rate = measure_bf16_matmul_rate() if on_gpu else None
    peer_tok_s: dict[int, float] = {}
    peer_points: list[dict[str, Any]] = []
    if peer == "hf":
        hf_points = run_hf_peer(
            engine_args.model,
            peer_sizes,
            input_len,
            output_len,
            config.model.dtype,
            config.device,
            data_seed,
            hf_attn_implementation,
        )
        peer_tok_s = {p.batch_size: p.decode_tok_s for p in hf_points}
        peer_points = [dataclasses.asdict(p) for p in hf_points]

    engine = LLMEngine(config)
    hf_config = config.model.hf_config
    dtype_bytes = config.model.dtype.itemsize
    vocab = config.model.vocab_size
    # Mean tokens attended to over the timed steps: the step making token j (2..N) attends to
    # input_len + j - 1 tokens, input_len + N / 2 on average.
    context_len = input_len + output_len // 2
    rng = random.Random(data_seed)
    gpu = gpu_name(config.device)
    points: list[dict[str, Any]] = []
    for b in batch_sizes:
        for w in range(warmup_runs):
            time_decode(engine, random_prompts(rng, b, input_len, vocab), output_len, f"w{w}-b{b}")
        r = time_decode(engine, random_prompts(rng, b, input_len, vocab), output_len, f"b{b}")
        step_bytes = decode_step_bytes(hf_config, b, context_len, dtype_bytes)
        step_flops = decode_step_flops(hf_config, b, context_len)
        roof = (
            None
            if bw is None or rate is None
            else roofline_tok_s(b, step_bytes, step_flops, bw, rate)
        )
        peer_value = peer_tok_s.get(b)
        points.append(
            {
                "batch_size": b,
                "decode_tok_s": r.decode_tok_s,
                "roofline_tok_s": roof,
                "pct_of_roofline": None if roof is None else 100 * r.decode_tok_s / roof,
                "peer_tok_s": peer_value,
                "speedup_vs_peer": None if peer_value is None else r.decode_tok_s / peer_value,
                "mean_step_ms": r.mean_step_ms,
                "decode_steps": r.decode_steps,
                "decode_tokens": r.decode_tokens,
                "elapsed_s": r.elapsed_s,
                "step_bytes": step_bytes,
                "step_flops": step_flops,
                "gpu": gpu,
                "engine_args": engine_options(engine_args),
            }
        )
    return {
        "gpu": gpu,
        "benchmark": "decode",
        "model": engine_args.model,
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "input_len": input_len,
        "output_len": output_len,
        "warmup_runs": warmup_runs,
        "roofline_context_len": context_len,
        "copy_bandwidth_bytes_per_s": bw,
        "bf16_matmul_flop_per_s": rate,
        "engine_args": engine_options(engine_args),
        "peer": None
        if peer is None
        else {
            "name": "hf-transformers-eager",
            "attn_implementation": hf_attn_implementation,
            "timing": "B*(output_len-1) / (t_generate(output_len) - t_generate(1))",
            "points": peer_points,
        },
        "points": points,
    }


def table(payload: dict[str, Any]) -> str:
    rows = [
        [
            str(p["batch_size"]),
            fmt(p["decode_tok_s"]),
            fmt(p["roofline_tok_s"]),
            fmt(p["pct_of_roofline"]),
            fmt(p["peer_tok_s"]),
            fmt(p["speedup_vs_peer"], 2),
        ]
        for p in payload["points"]
    ]
    headers = ["batch", "tok/s", "roofline tok/s", "% roofline", "peer tok/s", "speedup"]
    return format_table(headers, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=256, help="new tokens per request")
    parser.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="untimed runs of the same shape before each timed one (JIT, allocator)",
    )
    parser.add_argument("--peer", choices=["hf"], default=None, help="also measure a peer")
    parser.add_argument(
        "--peer-batch-sizes",
        type=int_list,
        default=None,
        help="batch sizes the peer runs, a subset of --batch-sizes (default: 1 and 64 among them)",
    )
    parser.add_argument("--data-seed", type=int, default=0, help="seeds the random prompts")
    add_peer_cli(parser)
    add_engine_cli(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    payload = run(
        EngineArgs.from_cli_args(ns),
        ns.batch_sizes,
        ns.input_len,
        ns.output_len,
        ns.warmup_runs,
        ns.peer,
        ns.peer_batch_sizes,
        ns.hf_attn_implementation,
        ns.data_seed,
    )
    path = write_result("decode", payload)
    print(f"wrote {path}")
    print(table(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
