"""The drain gate: once a process drains, calls that would start new work are refused
with UNAVAILABLE by the process itself, while the calls already running finish.

grpc's own shutdown also refuses new calls, but a call that races it ends UNAVAILABLE or
CANCELLED depending on where it was when the server stopped, and only UNAVAILABLE tells a
client to try another replica. So a draining process keeps its server up, refuses work at
this gate, waits for the work calls it took before to end, and only then stops grpc.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from services.common.rpc.handlers import Behavior, refusal, wrap_behavior


class DrainGate(grpc.aio.ServerInterceptor):
    """Refuses ``work_methods`` (full paths, ``/package.Service/Method``) once closed, and
    counts those in flight so the drain knows when the work it took is done. Other methods
    (health, abort, lease streams) pass untouched: a draining process still answers them.
    """

    def __init__(self, work_methods: Collection[str]) -> None:
        self._work_methods = frozenset(work_methods)
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.closed = False

    def close(self) -> None:
        self.closed = True

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no work call is in flight; returns whether that happened in time."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method not in self._work_methods:
            return handler
        if self.closed:
            return refusal(
                handler,
                grpc.StatusCode.UNAVAILABLE,
                "this replica is draining; send the call to another",
            )
        return wrap_behavior(handler, self._counted, self._counted_stream)

    def _begin(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _end(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    def _counted(self, behavior: Behavior) -> Behavior:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self._begin()
            try:
                return await behavior(request, context)
            finally:
                self._end()

        return run

    def _counted_stream(self, behavior: Behavior) -> Behavior:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            self._begin()
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                self._end()

        return run


def work_methods(service: ServiceDescriptor, methods: Collection[str]) -> list[str]:
    """Full paths of ``methods`` on ``service``; a name it lacks raises KeyError at start,
    not a gate that silently lets that call through."""
    return [f"/{service.full_name}/{service.methods_by_name[method].name}" for method in methods]
