"""The peer: Hugging Face transformers eager decode (no torch.compile, no CUDA graphs) on the same
device, with random weights built directly there.

Timing: decode tok/s = B x (N - 1) / (t_generate(N) - t_generate(1)) for B prompts of the same
length (no padding, attention mask of ones), greedy, N new tokens forced by min_new_tokens. The
difference of the two wall times is N - 1 decode steps: prefill and the first token cancel out.

    python -m benchmarks.peer_hf --batch-sizes 1,64
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

if not __package__:  # run as a file (python benchmarks/x.py): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    LLAMA_8B_DIR,
    fmt,
    format_table,
    gpu_name,
    int_list,
    synchronize,
    write_result,
)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class PeerPoint:
    batch_size: int
    decode_tok_s: float
    # Wall seconds of generate() with 1 and with output_len new tokens.
    t_first_s: float
    t_full_s: float


def load_hf_model(
    model_dir: str, dtype: torch.dtype, device: torch.device, attn_implementation: str
) -> Any:
    """A transformers causal LM with random weights, allocated and initialized on `device`."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    return model.eval()


def time_generate(model: Any, input_ids: torch.Tensor, new_tokens: int) -> float:
    """Wall seconds of one greedy generate() of exactly `new_tokens` tokens per row."""
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
    synchronize(input_ids.device)
    t0 = time.perf_counter()
    model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    synchronize(input_ids.device)
    return time.perf_counter() - t0


def measure_hf_decode(
    model: Any, batch_size: int, input_len: int, output_len: int, generator: torch.Generator
) -> PeerPoint:
    vocab = int(model.config.vocab_size)
    ids = torch.randint(vocab, (batch_size, input_len), generator=generator).to(model.device)
    time_generate(model, ids, min(output_len, 4))  # warm-up: kernels, cuBLAS workspaces, allocator
    # The fastest of a few prefill-only runs: a one-off stall there would inflate the decode rate
    # (or make the difference negative on a busy CPU with a tiny model); they cost one token each.
    t_first = min(time_generate(model, ids, 1) for _ in range(3))
    t_full = time_generate(model, ids, output_len)
    return PeerPoint(
        batch_size, batch_size * (output_len - 1) / (t_full - t_first), t_first, t_full
    )


def run_hf_peer(
    model_dir: str,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> list[PeerPoint]:
    """Decode speed of transformers at each batch size; the model is freed before returning."""
    if output_len < 2:
        raise ValueError(f"output_len={output_len} is invalid; accepted: >= 2 (one decode step)")
    model = load_hf_model(model_dir, dtype, device, attn_implementation)
    generator = torch.Generator().manual_seed(seed)
    try:
        return [measure_hf_decode(model, b, input_len, output_len, generator) for b in batch_sizes]
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def add_peer_cli(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf-attn-implementation",
        default="sdpa",
        choices=["sdpa", "eager"],
        help="transformers attention of the peer",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(LLAMA_8B_DIR))
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=list(_DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    add_peer_cli(parser)
    ns = parser.parse_args(argv)
    points = run_hf_peer(
        ns.model,
        ns.batch_sizes,
        ns.input_len,
        ns.output_len,
        _DTYPES[ns.dtype],
        torch.device(ns.device),
        ns.seed,
        ns.hf_attn_implementation,
    )
    gpu = gpu_name(torch.device(ns.device))
    payload = {
        "gpu": gpu,
        "benchmark": "peer_hf_decode",
        "model": ns.model,
        "dtype": ns.dtype,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "attn_implementation": ns.hf_attn_implementation,
        "timing": "B*(output_len-1) / (t_generate(output_len) - t_generate(1))",
        "points": [{**dataclasses.asdict(p), "gpu": gpu} for p in points],
    }
    path = write_result("peer-hf", payload)
    print(f"wrote {path}")
    rows = [[str(p.batch_size), fmt(p.decode_tok_s)] for p in points]
    print(format_table(["batch", "HF tok/s"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
