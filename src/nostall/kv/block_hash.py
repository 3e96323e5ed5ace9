"""Chained hashes of full KV blocks: the keys of the prefix cache.

The hash of block i covers the hash of block i - 1 and block i's token ids, so equal hashes mean
equal whole prefixes (up to a 64-bit collision). The value depends only on the bytes below, never on
the process, the machine or PYTHONHASHSEED: prefill and decode instances compare hashes.

Bytes hashed with SHA-256 (the first 8 digest bytes, read little-endian, are the hash):
- the parent hash as a little-endian uint64, omitted for the first block of a sequence;
- each token id as a little-endian int64.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block whose predecessor has `parent_hash` (None for the first block)."""
    data = b"" if parent_hash is None else struct.pack("<Q", parent_hash)
    data += struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def extend_block_hashes(
    block_hashes: list[int], token_ids: Sequence[int], block_size: int, num_full_blocks: int
) -> None:
    """Append the hashes of full blocks `len(block_hashes) .. num_full_blocks - 1` of `token_ids`.

    `block_hashes` must already hold the chain of the leading blocks of `token_ids`; blocks
    `0 .. num_full_blocks - 1` must be full (`num_full_blocks * block_size <= len(token_ids)`).
    """
    if num_full_blocks * block_size > len(token_ids):
        raise ValueError(
            f"num_full_blocks={num_full_blocks} needs {num_full_blocks * block_size} tokens"
            f" (block_size={block_size}); only {len(token_ids)} are known"
        )
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else None
        block_hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
