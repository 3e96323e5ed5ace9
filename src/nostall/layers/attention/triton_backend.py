"""The Triton backend: KV write, then split-KV decode or flash-attention prefill over paged KV.

No host synchronization anywhere (only host ints already in the metadata size the grids), and a
decode step launches the same kernels with the same grids for every step of a batch size, so decode
runs under CUDA-graph capture and under torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

import torch

from nostall.kernels.triton.kv_cache import write_kv_cache
from nostall.kernels.triton.paged_attention_decode import paged_attention_decode
from nostall.kernels.triton.paged_attention_prefill import paged_attention_prefill
from nostall.layers.attention.backend import AttentionBackend
from nostall.layers.attention.metadata import AttentionMetadata, KVCache


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

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
        if metadata.max_query_len == 1:
            # Pure decode: token r is request r's only query.
            return paged_attention_decode(
                q,
                kv_cache.key,
                kv_cache.value,
                metadata.seq_lens,
                metadata.block_tables,
                scale,
                sliding_window,
            )
        return paged_attention_prefill(
            q,
            kv_cache.key,
            kv_cache.value,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.max_query_len,
            scale,
            sliding_window,
        )
