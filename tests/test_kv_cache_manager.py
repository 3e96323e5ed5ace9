"""KVCacheManager: block tables, prefix hits, registration of full blocks, counters."""

from __future__ import annotations

import pytest

from nostall.kv.block_hash import hash_block
from nostall.kv.kv_cache_manager import KVCacheManager
from nostall.sampling_params import SamplingParams
from nostall.scheduler.request import Request

BLOCK_SIZE = 4


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def _admit(
    manager: KVCacheManager, request: Request, num_new_tokens: int | None = None
) -> list[int]:
    """Schedule a waiting request the way the scheduler does: hits, then the rest (or a chunk)."""
    hits, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    new_ids = manager.allocate_slots(request, num_new_tokens, hits, num_hit)
    assert new_ids is not None
    request.num_computed_tokens = num_hit + num_new_tokens
    return new_ids


def test_allocate_and_free() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = _request("a", list(range(10)))
    assert manager.allocate_slots(request, 10) == [1, 2, 3]
    assert manager.get_block_ids("a") == [1, 2, 3]
    assert manager.num_free_blocks == 4
    manager.free(request)
    assert manager.get_block_ids("a") == []
    assert manager.num_free_blocks == 7 and manager.usage == 0.0
    manager.free(request)
    manager.free(_request("unknown", [1]))
    assert manager.num_free_blocks == 7


def test_decode_appends_a_block_only_when_the_last_one_is_full() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    request = _request("a", list(range(7)))
    _admit(manager, request)
    request.append_output_token_ids(100)
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens += 1
    request.append_output_token_ids(101)
    assert manager.allocate_slots(request, 1) == [3]
    assert manager.get_block_ids("a") == [1, 2, 3]


def test_allocation_failure_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    holder = _request("holder", list(range(8)))
    _admit(manager, holder)
    request = _request("b", list(range(100, 112)))
    assert manager.allocate_slots(request, 12) is None
    assert manager.get_block_ids("b") == []
    assert manager.num_free_blocks == 1
    assert request.block_hashes == []


def test_requests_with_a_common_prefix_share_blocks() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prefix = list(range(8))
    a = _request("a", [*prefix, 50, 51])
    b = _request("b", [*prefix, 60, 61, 62])
    _admit(manager, a)
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2] and num_hit == 8
    assert manager.allocate_slots(b, 3, hits, num_hit) == [1, 2, 4]
    assert manager.get_block_ids("a") == [1, 2, 3]
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    manager.free(a)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    manager.free(b)
    assert manager.num_free_blocks == 15


def test_a_full_prompt_hit_still_leaves_one_token_to_compute() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(8))
    _admit(manager, _request("a", prompt))
    hits, num_hit = manager.get_computed_blocks(_request("b", prompt))
    assert len(hits) == 1 and num_hit == 4
    hits, num_hit = manager.get_computed_blocks(_request("c", [*prompt, 8]))
    assert len(hits) == 2 and num_hit == 8


def test_hit_and_query_counters_count_tokens() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    _admit(manager, _request("a", list(range(12))))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (12, 0)
    _admit(manager, _request("b", [*range(8), 99]))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (21, 8)


def test_caching_disabled_finds_and_counts_nothing() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_caching=False)
    prompt = list(range(12))
    _admit(manager, _request("a", prompt))
    b = _request("b", prompt)
    assert manager.get_computed_blocks(b) == ([], 0)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    assert manager.allocate_slots(b, 12) == [4, 5, 6]
    assert b.block_hashes == []


def test_blocks_are_registered_when_full_of_known_tokens() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    request = _request("a", list(range(10)))
    # The lookup hashed both full blocks of the prompt; a 5-token chunk registers block 0 only.
    _admit(manager, request, num_new_tokens=5)
    assert request.block_hashes[0] == hash_block(None, [0, 1, 2, 3])
    assert [manager.block_pool.blocks[i].block_hash for i in (1, 2)] == [
        request.block_hashes[0],
        None,
    ]
    # Slots beyond the known tokens (lookahead) never register a block.
    assert manager.allocate_slots(request, 15) == [3, 4, 5]
    request.num_computed_tokens = 10
    request.append_output_token_ids([10, 11])
    assert manager.allocate_slots(request, 2) == []
    assert len(request.block_hashes) == 3
    assert [manager.block_pool.blocks[i].block_hash for i in (1, 2, 3, 4, 5)] == [
        request.block_hashes[0],
        request.block_hashes[1],
        request.block_hashes[2],
        None,
        None,
    ]


def test_blocks_registered_this_step_are_hits_for_the_next_request() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(9))
    a = _request("a", prompt)
    _admit(manager, a)
    # Nothing has run yet, but a's KV is written before attention in the same step.
    b = _request("b", prompt)
    _, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8


def test_cached_blocks_of_a_finished_request_are_hits_later() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(13))
    a = _request("a", prompt)
    _admit(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 7
    b = _request("b", prompt)
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2, 3] and num_hit == 12
    assert manager.allocate_slots(b, 1, hits, num_hit) == [1, 2, 3, 4]
    assert manager.num_free_blocks == 3


def test_eviction_takes_a_freed_request_tail_first() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    a = _request("a", list(range(12)))
    _admit(manager, a)
    manager.free(a)
    # Block 4 (never cached) goes first, then a's tail (block 3), keeping a's head.
    c = _request("c", list(range(100, 108)))
    assert _admit(manager, c) == [4, 3]
    b = _request("b", list(range(13)))
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2] and num_hit == 8


def test_free_hits_count_against_free_blocks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = _request("a", list(range(8)))
    _admit(manager, a)
    manager.free(a)
    # 9 tokens: 2 hit blocks (both free) + 1 fresh = all 3 usable blocks.
    b = _request("b", list(range(9)))
    hits, num_hit = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, 1, hits, num_hit) == [1, 2, 3]
    manager.free(b)
    # 13 tokens need 4 blocks: refused, and the hits stay free.
    c = _request("c", list(range(13)))
    hits, num_hit = manager.get_computed_blocks(c)
    assert manager.allocate_slots(c, 5, hits, num_hit) is None
    assert manager.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in hits)


def test_identical_content_without_a_hit_keeps_its_own_blocks() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(8))
    a, b = _request("a", prompt), _request("b", prompt)
    assert manager.allocate_slots(a, 8) == [1, 2]
    assert manager.allocate_slots(b, 8) == [3, 4]
    assert a.block_hashes == b.block_hashes
    assert [blk.block_hash for blk in manager.block_pool.blocks[1:5]] == [
        *a.block_hashes,
        None,
        None,
    ]
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 15


def test_hits_are_only_for_a_request_without_blocks() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(9))
    _admit(manager, _request("a", prompt))
    b = _request("b", prompt)
    hits, num_hit = manager.get_computed_blocks(b)
    with pytest.raises(ValueError, match="does not match"):
        manager.allocate_slots(b, 1, hits, num_hit + 1)
    _admit(manager, b)
    with pytest.raises(ValueError, match="prefix hits only apply"):
        manager.allocate_slots(b, 1, hits, num_hit)


def test_reset_prefix_cache() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(9))
    a = _request("a", prompt)
    _admit(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(_request("b", prompt)) == ([], 0)
