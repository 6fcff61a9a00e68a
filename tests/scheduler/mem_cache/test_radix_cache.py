"""Radix prefix cache: matching, splitting, reference locks, LRU eviction, slot ownership."""

from __future__ import annotations

import random

import pytest
import torch

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.mem_cache.radix_cache import RadixCache


def make_cache(num_slots: int = 64) -> tuple[RadixCache, KVPool]:
    pool = KVPool(num_slots, 1, 1, 4, torch.float32)
    return RadixCache(pool), pool


def cache_tokens(cache: RadixCache, pool: KVPool, tokens: list[int]) -> list[int]:
    """Insert ``tokens`` the way a finished request does: allocate, insert, free duplicates."""
    slots = pool.allocate(len(tokens))
    num_present = cache.insert(tokens, slots)
    pool.free(slots[:num_present])
    return slots


def test_match_returns_longest_prefix_and_its_slots() -> None:
    cache, pool = make_cache()
    slots = cache_tokens(cache, pool, [1, 2, 3, 4, 5])
    match = cache.match_prefix([1, 2, 3, 9, 9])
    assert match.slots == slots[:3]
    assert match.node.key == [1, 2, 3]  # the edge was split at the match point
    assert cache.match_prefix([7, 1, 2]).slots == []
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots == slots
    assert cache.num_cached == 5


def test_insert_reports_present_prefix_and_keeps_first_copy() -> None:
    cache, pool = make_cache()
    first = cache_tokens(cache, pool, [1, 2, 3, 4])
    free_before = pool.num_free
    second = pool.allocate(6)
    assert cache.insert([1, 2, 3, 7, 8, 9], second) == 3
    pool.free(second[:3])  # the caller's duplicates of 1, 2, 3
    assert pool.num_free == free_before - 3
    assert cache.match_prefix([1, 2, 3, 7, 8, 9]).slots == first[:3] + second[3:]
    assert cache.match_prefix([1, 2, 3, 4]).slots == first
    assert cache.num_cached == 7


def test_locked_prefix_survives_eviction_and_unlock_makes_it_evictable() -> None:
    cache, pool = make_cache(16)
    cache_tokens(cache, pool, [1, 2, 3, 4])
    cache_tokens(cache, pool, [5, 6, 7])
    match = cache.match_prefix([1, 2, 3, 4])
    cache.lock(match.node)
    assert (cache.num_locked, cache.num_evictable) == (4, 3)
    assert cache.evict(100) == 3  # only the unlocked branch goes
    assert cache.match_prefix([1, 2, 3, 4]).slots == match.slots
    assert cache.match_prefix([5, 6, 7]).slots == []
    cache.unlock(match.node)
    assert (cache.num_locked, cache.num_evictable) == (0, 4)
    assert cache.reset()
    assert pool.num_free == 16 and cache.num_cached == 0


def test_eviction_is_least_recently_used_first() -> None:
    cache, pool = make_cache()
    cache_tokens(cache, pool, [1, 1, 1])
    cache_tokens(cache, pool, [2, 2, 2])
    cache_tokens(cache, pool, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # touch: now the newest
    assert cache.evict(3) == 3
    assert cache.match_prefix([2, 2, 2]).slots == []
    assert len(cache.match_prefix([1, 1, 1]).slots) == 3
    assert len(cache.match_prefix([3, 3, 3]).slots) == 3


def test_eviction_frees_a_parent_once_its_children_are_gone() -> None:
    cache, pool = make_cache()
    cache_tokens(cache, pool, [1, 2, 3, 4])
    cache_tokens(cache, pool, [1, 2, 5, 6])  # splits: [1, 2] -> {[3, 4], [5, 6]}
    assert cache.evict(6) == 6
    assert cache.num_cached == 0 and pool.num_free == pool.num_tokens


def test_split_keeps_locks_on_both_halves() -> None:
    cache, pool = make_cache()
    cache_tokens(cache, pool, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    cache.match_prefix([1, 2, 9])  # splits the locked edge
    assert (cache.num_locked, cache.num_evictable) == (4, 0)
    assert cache.evict(10) == 0
    assert not cache.reset()  # refused while locked
    cache.unlock(node)
    assert cache.num_evictable == 4 and cache.reset()


def test_random_workload_accounts_for_every_slot() -> None:
    """free + cached + held by 'requests' == total, through inserts, locks and evictions."""
    rng = random.Random(7)
    cache, pool = make_cache(256)
    held: list = []
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        match = cache.match_prefix(tokens)
        cache.lock(match.node)
        need = len(tokens) - len(match.slots)
        if pool.num_free < need:
            cache.evict(need - pool.num_free)
        if pool.num_free < need:
            cache.unlock(match.node)
            continue
        own = pool.allocate(need)
        slots = match.slots + own
        held.append((tokens, slots, match.node, len(match.slots)))
        if rng.random() < 0.5 or len(held) > 6:  # a request finishes and caches its tokens
            tokens, slots, node, num_shared = held.pop(rng.randrange(len(held)))
            num_present = cache.insert(tokens, slots)
            pool.free(slots[num_shared:num_present])
            cache.unlock(node)
        owned = sum(len(s) - n for _, s, _, n in held)
        assert pool.num_free + cache.num_cached + owned == pool.num_tokens
        assert all(n.lock_ref >= 0 for n in cache._nodes())
    for _, slots, node, num_shared in held:
        pool.free(slots[num_shared:])
        cache.unlock(node)
    assert cache.num_locked == 0
    assert cache.reset() and pool.num_free == pool.num_tokens


def test_insert_rejects_mismatched_lengths() -> None:
    cache, _ = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2], [0])
