"""What attention needs to know about one step, and the KV cache it reads and writes.

A step runs a flat batch of T tokens from R requests, request-major: the tokens of request r are
`query_start_loc[r]:query_start_loc[r + 1]`, and they are the *last* tokens of its sequence, so the
first of them sits at position `seq_lens[r] - (query_start_loc[r + 1] - query_start_loc[r])`.
This one layout serves prefill, chunked prefill over a cached prefix, and decode.

Every layer writes the new tokens' K and V into its cache (through `slot_mapping`) before it computes
attention, for all requests of the step. A request may therefore read blocks that another request of
the same step is filling (prefix-cache hits on blocks registered in this very step).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nostall.layers.attention.backend import AttentionBackend


@dataclasses.dataclass
class AttentionMetadata:
    # [R + 1] int32: cumulative query lengths, starting at 0.
    query_start_loc: torch.Tensor
    # [R] int32: KV length of each request after this step (cached prefix + new tokens).
    seq_lens: torch.Tensor
    # [R, max_blocks] int32: physical block ids of each request, padded with 0.
    block_tables: torch.Tensor
    # [T] int64: flat KV slot (block_id * block_size + offset) each new token writes to.
    slot_mapping: torch.Tensor
    # Host-side copies and bounds, known when the step is planned.
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclasses.dataclass
class KVCache:
    """One layer's paged cache: `key` and `value` are [num_blocks, block_size, num_kv_heads, head_dim]."""

    key: torch.Tensor
    value: torch.Tensor

    @property
    def block_size(self) -> int:
        return int(self.key.shape[1])


@dataclasses.dataclass
class AttentionContext:
    """Per-step state handed to the model's forward: metadata, every layer's cache, the backend."""

    metadata: AttentionMetadata
    kv_caches: list[KVCache]
    backend: AttentionBackend
