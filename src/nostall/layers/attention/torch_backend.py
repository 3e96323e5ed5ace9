"""The pure-PyTorch reference backend, built from kernels/ref (correct everywhere, fast nowhere)."""

from __future__ import annotations

import torch

from nostall.kernels.ref.kv_cache import write_kv_cache
from nostall.kernels.ref.paged_attention import paged_attention
from nostall.layers.attention.backend import AttentionBackend
from nostall.layers.attention.metadata import AttentionMetadata, KVCache


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache.key, kv_cache.value, metadata.slot_mapping)
        return paged_attention(
            q,
            kv_cache.key,
            kv_cache.value,
            metadata.query_start_loc_cpu,
            metadata.seq_lens_cpu,
            metadata.block_tables,
            scale,
            sliding_window,
        )
