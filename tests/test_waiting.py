"""The shared waiting helpers: they return once the check holds and fail past the timeout."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.waiting import eventually, wait_until


async def test_eventually_waits_for_a_plain_or_an_async_check() -> None:
    done = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, done.set)
    assert await eventually(done.is_set) >= 0.04

    async def is_set() -> bool:
        return done.is_set()

    assert await eventually(is_set) < 0.04  # already true: no wait


async def test_eventually_fails_past_its_timeout() -> None:
    with pytest.raises(AssertionError, match="never not reached"):
        await eventually(lambda: False, timeout=0.05, what="never")


def test_wait_until_waits_for_another_thread() -> None:
    done = threading.Event()
    threading.Timer(0.05, done.set).start()
    assert wait_until(done.is_set) >= 0.04
    with pytest.raises(AssertionError, match="never not reached"):
        wait_until(lambda: False, timeout=0.05, what="never")
