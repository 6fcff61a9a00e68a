"""Helpers for tests against the REAL four-process stack (services.launch.LocalStack)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.launch import LocalStack, StackPorts
from tests.waiting import wait_until

# One engine thread: four engineers share two cores.
SCHEDULER_ARGS = ["--kv-cache-tokens", "16384", "--num-threads", "1"]


@contextmanager
def running_stack(model_dir: Path, log_dir: Path) -> Iterator[LocalStack]:
    """Start the stack on free ports; on a failed start, print each service's log tail."""
    stack = LocalStack(
        str(model_dir), StackPorts.free(), scheduler_args=SCHEDULER_ARGS, log_dir=log_dir
    )
    try:
        stack.start()
    except BaseException:
        for log in sorted(log_dir.glob("*.log")):
            print(f"---- {log.name}\n{log.read_text(errors='replace')[-4000:]}")
        raise
    try:
        yield stack
    finally:
        stack.stop()


def sse_frames(raw: bytes) -> list[str]:
    """Split an SSE body into `data:` payloads, checking the framing on the way."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    events = raw.decode().split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e.removeprefix("data: ") for e in events]


def scheduler_info(stack: LocalStack) -> scheduler_pb2.SchedulerInfo:
    """The scheduler's own GetInfo answer."""
    with grpc.insecure_channel(stack.addr("scheduler")) as channel:
        return scheduler_pb2_grpc.SchedulerServiceStub(channel).GetInfo(
            scheduler_pb2.ServerInfoRequest(), timeout=5
        )


def scheduler_load(stack: LocalStack) -> tuple[int, int]:
    """(waiting, running) as the scheduler itself reports them."""
    info = scheduler_info(stack)
    return info.num_waiting, info.num_running


def seconds_until_idle(stack: LocalStack, limit_s: float) -> float:
    """How long the scheduler took to hold no request; fails past `limit_s`."""
    return wait_until(lambda: scheduler_load(stack) == (0, 0), limit_s, "an idle scheduler", 0.02)
