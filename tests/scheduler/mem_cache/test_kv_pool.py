"""KV pool: sized from a memory budget, allocated once, slots handed out and taken back."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.mem_cache.kv_pool import KVPool

SHAPE = (4, 2, 64, torch.bfloat16)  # layers, kv heads, head dim, dtype: the default model


def test_pool_sized_from_a_memory_budget_fits_it() -> None:
    budget = 3 * 2**20 + 123
    num_tokens = KVPool.tokens_for_budget(budget, *SHAPE)
    pool = KVPool(num_tokens, *SHAPE)
    assert pool.num_bytes <= budget < pool.num_bytes + KVPool.bytes_per_token(*SHAPE)
    assert KVPool.bytes_per_token(*SHAPE) == 2 * 4 * 2 * 64 * 2  # K and V, bf16


def test_allocate_and_free_account_for_every_slot() -> None:
    pool = KVPool(10, 1, 1, 4, torch.float32)
    first, second = pool.allocate(4), pool.allocate(6)
    assert sorted(first + second) == list(range(10)) and pool.num_free == 0
    assert not pool.can_allocate(1)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(first)
    assert pool.num_free == 4 and pool.can_allocate(4) and pool.allocate(0) == []
