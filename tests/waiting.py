"""Waiting in tests for something to happen, instead of sleeping for a guessed time.

A test that needs the system to reach a state waits for that state: an event of
its own, or a check polled here until it holds. The timeout only bounds a
failure (the check is expected to hold long before it), so a slow machine makes
a test slower, never wrong.

To show that something does *not* happen, wait for a later event that proves
the system has gone past the point where it would have acted; a short bounded
wait is the last resort, where no such event exists, and says why.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.01


async def eventually(
    check: Callable[[], bool | Awaitable[bool]],
    timeout: float = 5.0,
    what: str = "condition",
    poll: float = POLL_S,
) -> float:
    """Return once ``check()`` (a plain or an async predicate) holds, in seconds waited;
    fail the test if it does not within ``timeout``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not await _holds(check):
        waited = loop.time() - start
        assert waited < timeout, f"{what} not reached after {waited:.1f}s"
        await asyncio.sleep(poll)
    return loop.time() - start


def wait_until(
    check: Callable[[], bool],
    timeout: float = 5.0,
    what: str = "condition",
    poll: float = POLL_S,
) -> float:
    """``eventually`` for code outside an event loop (threads, processes, sync clients)."""
    start = time.monotonic()
    while not check():
        waited = time.monotonic() - start
        assert waited < timeout, f"{what} not reached after {waited:.1f}s"
        time.sleep(poll)
    return time.monotonic() - start


async def _holds(check: Callable[[], bool | Awaitable[bool]]) -> bool:
    result = check()
    if inspect.isawaitable(result):
        result = await result
    return bool(result)
