"""Engine configuration: frozen dataclasses, every "auto" resolved before anything is built."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from nostall.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how. Built by `nostall.models.loader.resolve_model_config`."""

    # A Hugging Face model directory, or the directory holding `gguf_file`.
    model_dir: str
    # File name of the GGUF checkpoint inside `model_dir`, or None for a safetensors directory.
    gguf_file: str | None
    # The transformers config (LlamaConfig, Qwen2Config, ...), read with transformers.
    hf_config: Any = dataclasses.field(compare=False, repr=False)
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    # Directory (and GGUF file) the tokenizer is read from.
    tokenizer_dir: str
    # Token ids that end generation unless ignore_eos (tokenizer eos + generation_config eos).
    eos_token_ids: tuple[int, ...] = ()
    # "auto": read the checkpoint; "dummy": random weights (benchmarks of speed, not of quality).
    load_format: str = "auto"

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        return int(
            getattr(self.hf_config, "num_key_value_heads", None)
            or self.hf_config.num_attention_heads
        )

    @property
    def head_dim(self) -> int:
        hd = getattr(self.hf_config, "head_dim", None)
        return int(hd or self.hf_config.hidden_size // self.hf_config.num_attention_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # GPU: fraction of device memory the engine may use in total (weights, activations, KV).
    gpu_memory_utilization: float = 0.9
    # CPU (or an explicit override anywhere): bytes of KV cache.
    kv_cache_memory_bytes: int | None = None
    # Exact number of KV blocks; overrides both budgets above (tests use it to force preemption).
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(
                f"block_size={self.block_size} is invalid; accepted: a power of two from 1 to 128"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is invalid; accepted: a number in (0, 1]"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} is invalid; accepted: a positive byte count"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError(
                f"num_gpu_blocks_override={self.num_gpu_blocks_override} is invalid; accepted: an integer >= 2"
            )


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(
                f"max_num_seqs={self.max_num_seqs} is invalid; accepted: an integer >= 1"
            )
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is invalid; accepted: an integer >= 1"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_model_len="
                f"{self.max_model_len}; without chunked prefill a whole prompt must fit in one step"
            )
