"""Per-request block tables over a `BlockPool`, with automatic prefix caching.

Invariants for every request `r` holding blocks:
- `block_table(r)[i]` holds the KV of tokens `i * block_size .. (i + 1) * block_size - 1` of
  `r.all_token_ids`; the table covers every token scheduled so far (computed or about to be).
- Its first `num_registered(r)` blocks are full of known tokens and have been offered to the prefix
  cache under `r.block_hashes[i]`. Where that hash already named another block, it keeps naming
  it, and `r` keeps its own equal but unfindable copy.
"""

from __future__ import annotations

from nostall.kv.block_hash import extend_block_hashes
from nostall.kv.block_pool import BlockPool, KVCacheBlock
from nostall.scheduler.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid; accepted: an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Both in tokens, summed over every call of get_computed_blocks.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._block_tables: dict[str, list[KVCacheBlock]] = {}
        self._num_registered: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `request.all_token_ids`, in whole blocks, leaving >= 1 token.

        For a request with no blocks (about to be scheduled from WAITING). Returns the hit blocks
        (not yet referenced: pass them to `allocate_slots`) and their number of tokens.
        """
        if not self.enable_caching:
            return [], 0
        num_tokens = request.num_tokens
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            num_tokens // self.block_size,
        )
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Grow the request's table to hold `num_computed + num_new_computed + num_new_tokens` tokens.

        Returns the ids of the blocks appended (hits first, then fresh ones), or None, changing
        nothing, when the pool lacks free blocks. Blocks that become full of known tokens are
        registered in the prefix cache now, before their KV is written: every layer writes a step's
        new KV before attention, so a request of the same step may already hit them.
        """
        hits = new_computed_blocks or []
        if num_new_computed_tokens != len(hits) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match {len(hits)} hit"
                f" blocks of {self.block_size} tokens"
            )
        table = self._block_tables.get(request.request_id, [])
        if hits and (table or request.num_computed_tokens):
            raise ValueError(
                f"request {request.request_id!r} already has {len(table)} blocks and"
                f" {request.num_computed_tokens} computed tokens; prefix hits only apply to a fresh one"
            )
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_fresh = max(0, -(-num_total // self.block_size) - len(table) - len(hits))
        # Hits that are free still count as free blocks until touched.
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_fresh + num_free_hits > self.block_pool.num_free_blocks:
            return None

        self.block_pool.touch(hits)
        new_blocks = hits + self.block_pool.get_new_blocks(num_fresh)
        table.extend(new_blocks)
        self._block_tables[request.request_id] = table
        if hits:
            self._num_registered[request.request_id] = len(hits)
        if self.enable_caching:
            self._register_full_blocks(request, table, min(num_total, request.num_tokens))
        return [block.block_id for block in new_blocks]

    def _register_full_blocks(
        self, request: Request, table: list[KVCacheBlock], num_known_tokens: int
    ) -> None:
        start = self._num_registered.get(request.request_id, 0)
        num_full = num_known_tokens // self.block_size
        if num_full <= start:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, num_full)
        self.block_pool.cache_full_blocks(
            table[start:num_full], request.block_hashes[start:num_full]
        )
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (so its tail is evicted first)."""
        table = self._block_tables.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        if table is not None:
            self.block_pool.free_blocks(reversed(table))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._block_tables.get(request_id, [])]

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (a copy), empty for a request holding no blocks."""
        return list(self._block_tables.get(request_id, []))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
