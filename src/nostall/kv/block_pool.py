"""Physical KV blocks: reference counts, the free queue, and the prefix-cache index.

Invariants (with `usable = num_blocks - 1`):
- Block 0 is the null block: never handed out, never freed; runners pad block tables with it.
- A usable block is free (in the free queue) exactly when its `ref_cnt` is 0, so
  `num_free_blocks + #{blocks with ref_cnt > 0} == usable`.
- `block.block_hash is not None` exactly when the index maps that hash to that block. A free block
  may keep its hash: it is still a prefix-cache hit until it is evicted (handed out again).
- Free queue order is the eviction order: first the free blocks without a hash (they hold nothing
  worth keeping), then the hashed ones, least recently freed first.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Sequence


@dataclasses.dataclass(eq=False)
class KVCacheBlock:
    """One physical block of `block_size` token slots in every layer's cache."""

    block_id: int
    # Number of requests whose block table holds this block.
    ref_cnt: int = 0
    # Chained hash of the block's tokens while it is registered in the prefix cache.
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks} is invalid; accepted: an integer >= 2 (block 0 is reserved)"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # block_id -> block, front = next to hand out.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[int, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by at least one request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` free blocks (ref_cnt 1 each), evicting the cached hashes they still hold."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks; only {self.num_free_blocks} are free")
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in this order.

        Hashed blocks go to the back (evicted last, in the given order); blocks without a hash go
        to the front, ahead of every hashed block, still in the given order.
        """
        unhashed: list[KVCacheBlock] = []
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"block {block.block_id} freed with ref_cnt={block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            self._free[block.block_id] = block
            if block.block_hash is None:
                unhashed.append(block)
        for block in reversed(unhashed):
            self._free.move_to_end(block.block_id, last=False)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int]
    ) -> None:
        """Register `blocks[i]` under `block_hashes[i]`: they are full and hold exactly that prefix.

        A hash that already names another block keeps naming it; the newcomer stays unregistered
        (two blocks with equal content may exist, but only one is findable).
        """
        if len(blocks) != len(block_hashes):
            raise ValueError(f"got {len(blocks)} blocks but {len(block_hashes)} hashes")
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise ValueError(
                        f"block {block.block_id} is cached as {block.block_hash:#x}; cannot re-cache"
                        f" it as {block_hash:#x}"
                    )
                continue
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is held by a request."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True
