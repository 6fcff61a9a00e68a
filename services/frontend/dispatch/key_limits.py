"""Per-key limits: requests in flight at once, and tokens per minute.

One frontend counts its own traffic; with several frontends a key's limits apply per
frontend. Tokens (prompt + completion) are charged when a choice finishes, and a key
over its budget for the last minute is refused until enough of it has aged out.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from services.common.auth.api_keys import ApiKey
from services.common.errors import RateLimitedError

WINDOW_S = 60.0
# What a refused caller is told to wait when a request ending frees the slot.
CONCURRENCY_RETRY_S = 1.0


class KeyLimiter:
    """Admits requests within each key's limits; a key without limits is never refused."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._spent: dict[str, deque[tuple[float, int]]] = {}

    def admit(self, key: ApiKey | None) -> None:
        """Count one request in flight for ``key``, or raise RateLimitedError."""
        if key is None:
            return
        live = self._in_flight.get(key.name, 0)
        if key.max_concurrent and live >= key.max_concurrent:
            raise RateLimitedError(
                f"key {key.name!r} has {live} requests in flight, its limit",
                retry_after_s=CONCURRENCY_RETRY_S,
            )
        wait_s = self._tokens_wait(key)
        if wait_s > 0:
            raise RateLimitedError(
                f"key {key.name!r} used its {key.tokens_per_minute} tokens per minute",
                retry_after_s=wait_s,
            )
        self._in_flight[key.name] = live + 1

    def release(self, key: ApiKey | None) -> None:
        """The request ``admit`` counted has ended."""
        if key is not None:
            left = self._in_flight.get(key.name, 0) - 1
            if left > 0:
                self._in_flight[key.name] = left
            else:
                self._in_flight.pop(key.name, None)

    def charge(self, key: ApiKey | None, num_tokens: int) -> None:
        if key is not None and key.tokens_per_minute and num_tokens > 0:
            self._spent.setdefault(key.name, deque()).append((self._clock(), num_tokens))

    def _tokens_wait(self, key: ApiKey) -> float:
        """Seconds until ``key`` is under its budget again (0: it is now)."""
        spent = self._spent.get(key.name)
        if not key.tokens_per_minute or not spent:
            return 0.0
        now = self._clock()
        while spent and spent[0][0] <= now - WINDOW_S:
            spent.popleft()
        total = sum(n for _, n in spent)
        if total < key.tokens_per_minute:
            return 0.0
        # Under budget once the oldest charges age out: wait for the last one needed.
        for at, num in spent:
            total -= num
            if total < key.tokens_per_minute:
                return max(at + WINDOW_S - now, 0.001)
        return WINDOW_S  # not reached: the total falls to 0, under any positive limit
