"""The scheduler's waiting queue: higher priority first, then arrival order.

A retracted request keeps its arrival number, so it goes back ahead of every
request of its priority that arrived after it, and resumes before them.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from services.scheduler.core.req import Req


class WaitingQueue:
    """Requests ordered by (-priority, arrival); only the scheduler thread touches it."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._reqs: list[Req] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        """Requests in admission order (a snapshot: removing while iterating is safe)."""
        return iter(list(self._reqs))

    def push(self, req: Req) -> None:
        """Queue ``req``; the first push fixes its place among equal priorities."""
        if req.arrival is None:
            req.arrival = next(self._arrivals)
        key = (-req.priority, req.arrival)
        index = bisect.bisect(self._keys, key)
        self._keys.insert(index, key)
        self._reqs.insert(index, req)

    def remove(self, req: Req) -> None:
        index = bisect.bisect_left(self._keys, (-req.priority, req.arrival or 0))
        if index >= len(self._reqs) or self._reqs[index] is not req:
            raise ValueError(f"request {req.rid!r} is not waiting")
        del self._keys[index]
        del self._reqs[index]
