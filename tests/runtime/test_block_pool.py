"""BlockPool: free list, reference counts, LRU eviction of cached blocks, chained hashes."""

from __future__ import annotations

import pytest

from kiln.runtime.core.block_pool import ROOT_HASH, BlockPool, hash_block_tokens


def test_initial_state():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    assert pool.num_used_blocks == 0
    assert pool.num_cached_blocks == 0
    pool.check_invariants()


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="at least 1 block, got 0"):
        BlockPool(0)


def test_allocate_and_free_roundtrip():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    assert all(pool.ref_cnt[b] == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    assert pool.ref_cnt == [0, 0, 0, 0]
    pool.check_invariants()


def test_allocate_too_many_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError, match="need 2 blocks, only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match=f"double free of KV block {b}"):
        pool.free([b])


def test_hash_chaining():
    a = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])  # stable
    assert a != hash_block_tokens(ROOT_HASH, [1, 2, 3, 5])
    b1 = hash_block_tokens(a, [5, 6, 7, 8])
    b2 = hash_block_tokens(hash_block_tokens(ROOT_HASH, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert b1 != b2  # same tokens, different prefix -> different hash
    assert len(a) == 32


def test_cached_block_becomes_evictable_then_reusable():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    h = hash_block_tokens(ROOT_HASH, [1, 2])
    assert pool.cache_block(b, h)
    pool.free([b])
    assert pool.is_evictable(b)
    assert pool.num_free_blocks == 3  # evictable blocks count as free
    assert pool.get_cached_block(h) == b
    pool.touch([b])  # a cache hit revives it
    assert pool.ref_cnt[b] == 1 and not pool.is_evictable(b)
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_free_blocks_used_before_evicting_cached():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], b"h0" * 16)
    pool.free(blocks)
    # Two plain free blocks go first; the cached one survives until needed.
    got = pool.allocate(2)
    assert blocks[0] not in got
    assert pool.get_cached_block(b"h0" * 16) == blocks[0]
    (last,) = pool.allocate(1)
    assert last == blocks[0]
    assert pool.get_cached_block(b"h0" * 16) is None  # evicted
    assert pool.block_hash[last] is None
    pool.check_invariants()


def test_lru_eviction_order():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [bytes([i]) * 32 for i in range(3)]
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h)
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[1]])
    assert pool.allocate(1) == [blocks[2]]  # least recently freed first
    assert pool.allocate(1) == [blocks[0]]
    pool.check_invariants()


def test_one_block_per_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = b"x" * 32
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)  # b stays private
    assert pool.block_hash[b] is None
    assert pool.cache_block(a, h)  # idempotent
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_block(a, b"y" * 32)
    pool.free([a, b])
    assert pool.num_evictable_blocks == 1
    pool.check_invariants()


def test_cache_requires_in_use_block():
    pool = BlockPool(1)
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_block(0, b"x" * 32)


def test_touch_free_uncached_block_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="cannot be shared"):
        pool.touch([0])


def test_reset_cache():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"x" * 32)
    assert not pool.reset_cache()  # blocks in use
    pool.free([a, b])
    assert pool.reset_cache()
    assert pool.num_cached_blocks == 0 and pool.num_evictable_blocks == 0
    assert pool.num_free_blocks == 2
    pool.check_invariants()
