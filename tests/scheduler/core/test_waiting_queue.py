"""Waiting queue order: priority first, arrival order within a priority, retracted requests
back in their original place."""

from __future__ import annotations

import pytest

from services.scheduler.core.waiting_queue import WaitingQueue
from tests.scheduler.factories import make_req


def make(rid: str, priority: int = 0):
    req = make_req(rid, [0, 1])
    req.priority = priority
    return req


def test_priority_then_arrival_order() -> None:
    queue = WaitingQueue()
    for rid, priority in [("a", 0), ("b", 2), ("c", 0), ("d", 2), ("e", -1)]:
        queue.push(make(rid, priority))
    assert [r.rid for r in queue] == ["b", "d", "a", "c", "e"]


def test_a_retracted_request_returns_ahead_of_later_arrivals() -> None:
    queue = WaitingQueue()
    first, second = make("first"), make("second")
    queue.push(first)
    queue.push(second)
    queue.remove(first)  # admitted
    queue.push(make("third"))
    queue.push(first)  # retracted: keeps its arrival number
    assert [r.rid for r in queue] == ["first", "second", "third"]


def test_remove_while_iterating_and_missing_requests() -> None:
    queue = WaitingQueue()
    reqs = [make(str(i)) for i in range(4)]
    for req in reqs:
        queue.push(req)
    for req in queue:
        if req.rid in ("1", "2"):
            queue.remove(req)
    assert [r.rid for r in queue] == ["0", "3"] and len(queue) == 2
    with pytest.raises(ValueError):
        queue.remove(reqs[1])
