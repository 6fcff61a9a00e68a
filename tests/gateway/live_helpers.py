"""Helpers for tests against the REAL four-process stack (services.launch.LocalStack)."""

from __future__ import annotations

from services.launch import LocalStack


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
