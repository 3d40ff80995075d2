"""KVCacheManager: block tables, prefix-cache lookups, allocation that fails cleanly."""

from __future__ import annotations

import pytest

from kiln.runtime.core.kv_cache_manager import KVCacheManager
from kiln.runtime.core.request import Request

BS = 4


def req(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, list(prompt), max_tokens=max_tokens)


def admit(kv: KVCacheManager, r: Request, num_new: int | None = None) -> list[int] | None:
    """Admission as the scheduler does it; computes the whole prompt unless told."""
    blocks, n = kv.get_computed_blocks(r)
    num_new = r.num_tokens - n if num_new is None else num_new
    got = kv.allocate_slots(r, num_new, blocks)
    if got is not None:
        r.num_computed_tokens = n
        r.num_cached_tokens = n
    return got


def step(kv: KVCacheManager, r: Request, num_new: int) -> None:
    """What update_from_output does for the KV side."""
    r.num_computed_tokens += num_new
    kv.cache_blocks(r, r.num_computed_tokens)


def test_allocate_covers_tokens():
    kv = KVCacheManager(10, BS)
    r = req("a", range(10))
    got = admit(kv, r)
    assert got == [0, 1, 2]  # 10 tokens -> 3 blocks
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 7
    assert kv.usage == pytest.approx(0.3)
    kv.check_invariants()


def test_allocate_none_changes_nothing():
    kv = KVCacheManager(3, BS)
    a = req("a", range(8))
    assert admit(kv, a) == [0, 1]
    b = req("b", range(100, 108))
    assert admit(kv, b) is None
    assert kv.get_block_ids("b") == []
    assert kv.num_free_blocks == 1
    assert kv.num_requests == 1
    kv.check_invariants()


def test_decode_allocates_only_when_last_block_full():
    kv = KVCacheManager(10, BS)
    r = req("a", range(7))
    admit(kv, r)
    step(kv, r, 7)
    r.append_output_token(99)  # 8 tokens, 7 computed: slot 7 fits in block 1
    assert kv.allocate_slots(r, 1) == []
    step(kv, r, 1)
    r.append_output_token(98)  # token 8 needs a third block
    new = kv.allocate_slots(r, 1)
    assert new is not None and len(new) == 1
    assert len(kv.get_block_ids("a")) == 3
    kv.check_invariants()


def test_prefix_hit_never_covers_last_token():
    kv = KVCacheManager(10, BS)
    a = req("a", range(8))  # exactly two full blocks
    admit(kv, a)
    step(kv, a, 8)
    b = req("b", range(8))
    blocks, n = kv.get_computed_blocks(b)
    assert n == 4 and blocks == kv.get_block_ids("a")[:1]  # the last token is recomputed
    c = req("c", list(range(8)) + [50])
    blocks, n = kv.get_computed_blocks(c)
    assert n == 8 and blocks == kv.get_block_ids("a")


def test_prefix_sharing_and_stats():
    kv = KVCacheManager(10, BS)
    a = req("a", list(range(10)))
    admit(kv, a)
    step(kv, a, 10)  # blocks 0, 1 full and cached; block 2 partial
    assert kv.num_cached_blocks == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)

    b = req("b", list(range(8)) + [70, 71, 72])
    got = admit(kv, b)
    ta, tb = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    assert got == tb
    assert b.num_computed_tokens == 8
    assert kv.pool.ref_cnt[ta[0]] == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)

    # A different first block shares nothing, even if later tokens match.
    c = req("c", [999] + list(range(1, 10)))
    blocks, n = kv.get_computed_blocks(c)
    assert (blocks, n) == ([], 0)
    kv.check_invariants()


def test_stats_counted_once_per_admission():
    kv = KVCacheManager(10, BS)
    r = req("a", range(6))
    kv.get_computed_blocks(r)
    kv.get_computed_blocks(r)  # blocked at the queue head, retried next step
    assert kv.prefix_cache_queries == 6
    kv.free(r)  # e.g. preempted: the next admission counts again
    kv.get_computed_blocks(r)
    assert kv.prefix_cache_queries == 12


def test_free_is_idempotent_and_returns_everything():
    kv = KVCacheManager(6, BS)
    a = req("a", range(9))
    admit(kv, a)
    step(kv, a, 9)
    b = req("b", list(range(8)) + [5])
    admit(kv, b)
    kv.free(a)
    kv.free(a)
    assert kv.num_allocated_uncached_blocks == len(kv.get_block_ids("b"))
    kv.free(b)
    kv.free(b)
    assert kv.num_allocated_uncached_blocks == 0
    assert kv.num_free_blocks == 6
    assert kv.num_cached_blocks == 2  # still reusable
    kv.check_invariants()


def test_hit_on_evictable_block_counts_against_free_space():
    kv = KVCacheManager(3, BS)
    a = req("a", range(9))
    admit(kv, a)
    step(kv, a, 9)
    kv.free(a)  # 2 evictable + 1 free
    assert kv.num_free_blocks == 3
    # Shares 2 evictable blocks, needs 2 fresh ones: 4 > 3 available.
    b = req("b", list(range(8)) + [1, 2, 3, 4, 5])
    assert admit(kv, b) is None
    assert kv.num_free_blocks == 3 and kv.num_cached_blocks == 2
    # Needs only 1 fresh block: fits, and the shared blocks are revived, not evicted.
    c = req("c", list(range(8)) + [1, 2])
    assert admit(kv, c) is not None
    assert c.num_computed_tokens == 8
    assert kv.num_free_blocks == 0
    kv.check_invariants()


def test_concurrent_identical_prefixes_stay_private():
    kv = KVCacheManager(10, BS)
    a, b = req("a", range(9)), req("b", range(9))
    admit(kv, a)
    admit(kv, b)  # a not computed yet: no hit
    assert b.num_computed_tokens == 0
    step(kv, a, 9)
    step(kv, b, 9)  # same hashes: b's copies stay uncached
    ta, tb = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert set(ta).isdisjoint(tb)
    assert kv.num_cached_blocks == 2
    kv.free(b)
    assert kv.num_evictable_blocks == 0  # b's blocks went back to the plain free list
    kv.check_invariants()


def test_output_tokens_are_cached_too():
    kv = KVCacheManager(10, BS)
    a = req("a", range(3))
    admit(kv, a)
    step(kv, a, 3)
    a.append_output_token(42)
    kv.allocate_slots(a, 1)
    step(kv, a, 1)
    assert kv.num_cached_blocks == 1  # prompt (3) + first output fill block 0
    b = req("b", [0, 1, 2, 42, 7])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 4


def test_prefix_caching_disabled():
    kv = KVCacheManager(10, BS, enable_prefix_caching=False)
    a = req("a", range(9))
    admit(kv, a)
    step(kv, a, 9)
    assert kv.num_cached_blocks == 0
    assert kv.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert kv.prefix_cache_queries == 0
    kv.free(a)
    assert kv.num_evictable_blocks == 0


def test_hits_only_on_admission():
    kv = KVCacheManager(10, BS)
    a = req("a", range(9))
    admit(kv, a)
    with pytest.raises(ValueError, match="only accepted on admission"):
        kv.allocate_slots(a, 1, [5])
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        kv.allocate_slots(a, -1)


def test_reset_prefix_cache():
    kv = KVCacheManager(10, BS)
    a = req("a", range(9))
    admit(kv, a)
    step(kv, a, 9)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 0
    assert kv.get_computed_blocks(req("b", range(9))) == ([], 0)
    kv.check_invariants()


def test_check_invariants_detects_ref_mismatch():
    kv = KVCacheManager(4, BS)
    a = req("a", range(5))
    admit(kv, a)
    kv.pool.ref_cnt[kv.get_block_ids("a")[0]] += 1
    with pytest.raises(AssertionError, match="ref_cnt 2 but held by 1"):
        kv.check_invariants()
