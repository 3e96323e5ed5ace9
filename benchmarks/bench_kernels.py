"""Time the Triton paged-attention kernels on the GPU (bf16, random data, shuffled block tables).

Cases: decode at batch 1 x 8k context and at batch 256 x 512 context, prefill of 1 x 4096 tokens,
all with 32 query heads, 8 KV heads, head_dim 128, block size 16. Each time is the median of
triton.testing.do_bench; decode is also timed as a CUDA-graph replay (how the engine runs it).
"Bandwidth" is the bytes of K and V the step must read (each visible key once) over the time; the
device-copy rate of the same bytes (read + write) is printed beside it as a roofline, and dense
torch SDPA over the same (unpaged) K/V as a peer. Every case is first checked against the
pure-torch reference.

Run: python benchmarks/bench_kernels.py  (results also go to $OUT/bench_kernels.json if OUT is set)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from nostall.kernels.ref.paged_attention import paged_attention
from nostall.kernels.triton.paged_attention_decode import (
    default_num_splits,
    paged_attention_decode,
)
from nostall.kernels.triton.paged_attention_prefill import paged_attention_prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "decode" or "prefill"
    batch: int
    seq_len: int
    # Queries per request: 1 for decode, seq_len for a whole-prompt prefill.
    q_len: int


CASES = [
    Case("decode_b1_ctx8192", "decode", 1, 8192, 1),
    Case("decode_b256_ctx512", "decode", 256, 512, 1),
    Case("prefill_1x4096", "prefill", 1, 4096, 4096),
]


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    # Dense per-request K/V [batch, KVH, seq_len, D] for the SDPA peer.
    dense_k: torch.Tensor
    dense_v: torch.Tensor


def _inputs(case: Case, device: torch.device) -> Inputs:
    blocks_per_req = triton.cdiv(case.seq_len, BLOCK_SIZE)
    num_blocks = case.batch * blocks_per_req
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=DTYPE, device=device)
    value_cache = torch.randn(shape, dtype=DTYPE, device=device)
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(
        case.batch, blocks_per_req
    )
    seq_lens = torch.full((case.batch,), case.seq_len, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(
        0, (case.batch + 1) * case.q_len, case.q_len, dtype=torch.int32, device=device
    )
    q = torch.randn(case.batch * case.q_len, HEADS, HEAD_DIM, dtype=DTYPE, device=device)

    def dense(cache: torch.Tensor) -> torch.Tensor:
        flat = cache[block_tables.long()].view(case.batch, -1, KV_HEADS, HEAD_DIM)
        return flat[:, : case.seq_len].transpose(1, 2).contiguous()

    return Inputs(
        q,
        key_cache,
        value_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        dense(key_cache),
        dense(value_cache),
    )


def _kernel(case: Case, inputs: Inputs) -> Callable[[], torch.Tensor]:
    scale = HEAD_DIM**-0.5
    if case.kind == "decode":
        return lambda: paged_attention_decode(
            inputs.q,
            inputs.key_cache,
            inputs.value_cache,
            inputs.seq_lens,
            inputs.block_tables,
            scale,
        )
    return lambda: paged_attention_prefill(
        inputs.q,
        inputs.key_cache,
        inputs.value_cache,
        inputs.query_start_loc,
        inputs.seq_lens,
        inputs.block_tables,
        case.q_len,
        scale,
    )


def _sdpa_peer(case: Case, inputs: Inputs) -> Callable[[], torch.Tensor]:
    """Dense SDPA over the same keys: [batch, H, q_len, D] queries, GQA through enable_gqa."""
    q = inputs.q.view(case.batch, case.q_len, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    return lambda: F.scaled_dot_product_attention(
        q,
        inputs.dense_k,
        inputs.dense_v,
        is_causal=case.kind == "prefill",
        scale=HEAD_DIM**-0.5,
        enable_gqa=True,
    )


def _relative_error(case: Case, inputs: Inputs, out: torch.Tensor) -> float:
    ref = paged_attention(
        inputs.q,
        inputs.key_cache,
        inputs.value_cache,
        inputs.query_start_loc.cpu(),
        inputs.seq_lens.cpu(),
        inputs.block_tables,
        HEAD_DIM**-0.5,
    )
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _graph_time_ms(fn: Callable[[], torch.Tensor]) -> float:
    """Median time of fn replayed as a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, return_mode="median"))


def _copy_time_ms(num_bytes: int) -> float:
    """Median time to copy num_bytes on the device (reads and writes them once)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return float(triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median"))


def _commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return result.stdout.strip()


def bench(case: Case) -> dict[str, Any]:
    inputs = _inputs(case, torch.device("cuda"))
    kernel = _kernel(case, inputs)
    error = _relative_error(case, inputs, kernel())
    if not error <= 1e-2:
        raise AssertionError(f"{case.name}: relative error {error:.3g} vs the reference > 1e-2")
    # Each visible key's K and V, read once.
    kv_bytes = case.batch * case.seq_len * KV_HEADS * HEAD_DIM * 2 * inputs.key_cache.element_size()
    ms = float(triton.testing.do_bench(kernel, return_mode="median"))
    sdpa_ms = float(triton.testing.do_bench(_sdpa_peer(case, inputs), return_mode="median"))
    result: dict[str, Any] = {
        "case": case.name,
        "batch": case.batch,
        "seq_len": case.seq_len,
        "q_len": case.q_len,
        "relative_error": error,
        "kv_bytes": kv_bytes,
        "time_us": ms * 1e3,
        "bandwidth_tb_s": kv_bytes / (ms * 1e-3) / 1e12,
        "device_copy_tb_s": 2 * kv_bytes / (_copy_time_ms(kv_bytes) * 1e-3) / 1e12,
        "sdpa_dense_time_us": sdpa_ms * 1e3,
    }
    if case.kind == "decode":
        result["num_splits"] = default_num_splits(case.batch, KV_HEADS, inputs.q.device)
        graph_ms = _graph_time_ms(kernel)
        result["graph_time_us"] = graph_ms * 1e3
        result["graph_bandwidth_tb_s"] = kv_bytes / (graph_ms * 1e-3) / 1e12
    else:
        # QK^T and PV over the causal triangle: 2 matmuls x 2 flops per multiply-add.
        pairs = case.batch * case.q_len * (case.q_len + 1) // 2
        result["tflop_s"] = 4 * pairs * HEADS * HEAD_DIM / (ms * 1e-3) / 1e12
        result["sdpa_dense_tflop_s"] = 4 * pairs * HEADS * HEAD_DIM / (sdpa_ms * 1e-3) / 1e12
    return result


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    torch.manual_seed(0)
    results = []
    for case in CASES:
        result = bench(case)
        results.append(result)
        print(
            json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})
        )
    report = {
        "benchmark": "bench_kernels",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE)},
        "block_size": BLOCK_SIZE,
        "results": results,
    }
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "bench_kernels.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
