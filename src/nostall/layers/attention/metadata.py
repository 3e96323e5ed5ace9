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


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata of a step, from host lists, where request r runs its last query_lens[r] of
    seq_lens[r] tokens. (The runner's steady path builds the same on the device instead.)"""
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    slots = []
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max(len(t) for t in block_tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    query_start_cpu = torch.tensor(query_start, dtype=torch.int32)
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=query_start_cpu.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_cpu,
        seq_lens_cpu=seq_lens_cpu,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


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
