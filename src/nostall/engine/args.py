"""User-facing engine options (Python keywords and CLI flags, named like vLLM's) and their resolution."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from nostall.config import CacheConfig, ModelConfig, SchedulerConfig
from nostall.errors import ConfigError
from nostall.models.loader import resolve_model_config


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: torch.device
    seed: int
    # No tokenizer: prompts are token ids, outputs carry ids and no text.
    skip_tokenizer_init: bool = False
    # Plan step N+1 while the device runs step N; results are processed one step late.
    async_scheduling: bool = True
    # No CUDA graphs: every step runs eagerly.
    enforce_eager: bool = False
    # "auto": triton on CUDA, torch (the reference) elsewhere.
    attention_backend: str = "auto"


@dataclasses.dataclass
class EngineArgs:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    device: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    async_scheduling: bool = True
    enforce_eager: bool = False
    attention_backend: str = "auto"

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(
                f"unknown engine option(s) {unknown}; accepted: {', '.join(sorted(names))}"
            )
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        device = _resolve_device(self.device)
        model_config = resolve_model_config(
            self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            device=device.type,
            load_format=self.load_format,
        )
        max_len = model_config.max_model_len
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 8192 if self.enable_chunked_prefill else max(8192, max_len)
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            device=device,
            seed=self.seed,
            skip_tokenizer_init=self.skip_tokenizer_init,
            async_scheduling=self.async_scheduling,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = EngineArgs.__dataclass_fields__
        g = parser.add_argument_group("engine")
        g.add_argument(
            "--dtype",
            default=d["dtype"].default,
            choices=["auto", "float32", "bfloat16", "float16"],
        )
        g.add_argument(
            "--max-model-len", type=int, default=None, help="context length (default: the model's)"
        )
        g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
        g.add_argument(
            "--max-num-batched-tokens", type=int, default=None, help="token budget per step"
        )
        g.add_argument("--block-size", type=int, default=d["block_size"].default)
        g.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
        )
        g.add_argument(
            "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
        )
        g.add_argument(
            "--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"].default
        )
        g.add_argument(
            "--kv-cache-memory-bytes",
            type=int,
            default=None,
            help="KV cache size (CPU default 4 GiB)",
        )
        g.add_argument("--num-gpu-blocks-override", type=int, default=None)
        g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        g.add_argument(
            "--seed", type=int, default=0, help="seeds the random streams of unseeded requests"
        )
        g.add_argument(
            "--load-format",
            default="auto",
            choices=["auto", "dummy"],
            help="dummy: random weights, no checkpoint read (for speed measurements)",
        )
        g.add_argument(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="plan the next step while the device runs this one (--no-async-scheduling: off)",
        )
        g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
        g.add_argument(
            "--attention-backend",
            default="auto",
            choices=["auto", "triton", "torch"],
            help="auto: triton on CUDA, torch (the reference) elsewhere",
        )
        g.add_argument(
            "--skip-tokenizer-init",
            action="store_true",
            help="no tokenizer: prompts are token ids, outputs have no text",
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"device={device!r} is invalid; accepted: auto, cpu, cuda, cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"device={device!r} asked for, but no CUDA GPU is available; use device='cpu'"
        )
    return torch.device(device)
