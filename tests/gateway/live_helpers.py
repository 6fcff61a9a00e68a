"""Helpers for tests against the REAL four-process stack (services.launch.LocalStack)."""

from __future__ import annotations

from services.launch import LocalStack
from tests.waiting import wait_until


def sse_frames(raw: bytes) -> list[str]:
    """Split an SSE body into `data:` payloads, checking the framing on the way."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    events = raw.decode().split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e.removeprefix("data: ") for e in events]


def scheduler_load(stack: LocalStack) -> tuple[int, int]:
    """(waiting, running) as the scheduler itself reports them."""
    info = stack.scheduler_info()
    return info.num_waiting, info.num_running


def seconds_until_idle(stack: LocalStack, limit_s: float) -> float:
    """How long the scheduler took to hold no request; fails past `limit_s`."""
    return wait_until(lambda: scheduler_load(stack) == (0, 0), limit_s, "an idle scheduler", 0.02)
