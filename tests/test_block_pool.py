"""BlockPool and block hashing: reference counts, the null block, LRU eviction, the hash index."""

from __future__ import annotations

import hashlib

import pytest

from nostall.kv.block_hash import extend_block_hashes, hash_block
from nostall.kv.block_pool import BlockPool


def _ids(blocks: list) -> list[int]:
    return [b.block_id for b in blocks]


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.num_free_blocks == 4
    assert _ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 0


def test_null_block_cannot_be_freed() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    with pytest.raises(ValueError, match="block 0"):
        pool.free_blocks([pool.null_block])


def test_pool_needs_one_usable_block() -> None:
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_ref_counts_free_count_and_usage() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=False)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    assert pool.usage == pytest.approx(0.5)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 0)
    assert pool.num_free_blocks == 3
    pool.free_blocks([a])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(ValueError, match="ref_cnt=0"):
        pool.free_blocks([a])


def test_freed_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [11, 12, 13])
    # A request frees its blocks tail first, so its tail is evicted first.
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 5
    # Blocks 4 and 5 never held a hash: they go before any cached block.
    assert _ids(pool.get_new_blocks(2)) == [4, 5]
    evicted = pool.get_new_blocks(1)
    assert _ids(evicted) == [3]
    assert evicted[0].block_hash is None and pool.get_cached_block(13) is None
    assert pool.get_cached_block(11) is blocks[0]
    assert pool.get_cached_block(12) is blocks[1]


def test_unhashed_freed_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    cached, plain_a, plain_b = pool.get_new_blocks(3)
    pool.cache_full_blocks([cached], [7])
    pool.free_blocks([cached, plain_a, plain_b])
    assert _ids(pool.get_new_blocks(2)) == [plain_a.block_id, plain_b.block_id]
    assert pool.get_cached_block(7) is cached


def test_touch_takes_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    block, other = pool.get_new_blocks(2)
    pool.cache_full_blocks([block], [42])
    pool.free_blocks([block, other])
    assert pool.num_free_blocks == 2
    hit = pool.get_cached_block(42)
    assert hit is block
    pool.touch([hit])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    assert pool.get_new_blocks(1) == [other]
    assert block.block_hash == 42


def test_a_hash_names_one_block_first_registration_wins() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [5])
    pool.cache_full_blocks([second], [5])
    assert pool.get_cached_block(5) is first
    assert second.block_hash is None
    # Re-registering a block under its own hash is a no-op; under another hash an error.
    pool.cache_full_blocks([first], [5])
    with pytest.raises(ValueError, match="cannot re-cache"):
        pool.cache_full_blocks([first], [6])


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [9])
    assert block.block_hash is None and pool.get_cached_block(9) is None


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(1) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 3


def _reference_hash(parent: int | None, tokens: list[int]) -> int:
    data = b"" if parent is None else parent.to_bytes(8, "little")
    data += b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def test_block_hash_is_fixed_sha256_of_little_endian_int64() -> None:
    first = hash_block(None, [1, 2, 3, 4])
    second = hash_block(first, [5, 6, 7, 8])
    assert first == _reference_hash(None, [1, 2, 3, 4]) == 0x6DC848B0E200E273
    assert second == _reference_hash(first, [5, 6, 7, 8]) == 0xC109A3DFCA176D35
    assert 0 <= second < 2**64


def test_block_hash_depends_on_the_whole_prefix() -> None:
    a = hash_block(None, [1, 2])
    b = hash_block(None, [3, 4])
    assert hash_block(a, [9, 9]) != hash_block(b, [9, 9])
    assert hash_block(None, [9, 9]) != hash_block(a, [9, 9])


def test_extend_block_hashes_chains_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, block_size=4, num_full_blocks=1)
    extend_block_hashes(hashes, tokens, block_size=4, num_full_blocks=2)
    assert hashes == [hash_block(None, [0, 1, 2, 3]), hash_block(hashes[0], [4, 5, 6, 7])]
    with pytest.raises(ValueError, match="only 10 are known"):
        extend_block_hashes(hashes, tokens, block_size=4, num_full_blocks=3)
