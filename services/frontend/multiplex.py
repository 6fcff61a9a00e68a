"""The frontend's side of ``Multiplex``: many streamed generations on one gRPC stream.

A per-request server stream costs the frontend one gRPC write (and the gateway one
read) for every token of every request: on two shared cores that per-message cost,
not the model, bounded what the stack served. Here each opened stream runs as a task
of its own over the same ``*.stream`` generator its per-request RPC uses, and puts
its messages in one outbox; the writer sends whatever the outbox holds as one
``MuxBatch``. Every stream's consumer wakes in the same turn of the event loop when a
step's rows arrive, so a batch carries that step's frames for every stream, and when
the gateway reads slowly the frames of several steps go together.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import status_pb2
from tokenline.v1 import frontend_pb2

from services.common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    ResourceExhaustedError,
    TokenlineError,
    UnavailableError,
    status_of,
)

if TYPE_CHECKING:
    from services.frontend.metrics import FrontendMetrics

# A stream's messages, from its request (``MuxRequest.chat`` or ``.completion``).
StreamOpener = Callable[[frontend_pb2.MuxRequest], AsyncGenerator[Any, None]]
_OPEN_KINDS = frozenset({"chat", "completion"})
_OK = status_pb2.Status()
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def grpc_code_name(code: int) -> str:
    """A status's code as grpc names it (the `grpc_code` label of the RPC metrics)."""
    return _CODE_NAMES.get(code, "UNKNOWN")


class StreamBudget:
    """What every Multiplex call of this frontend shares: the bound on live streams,
    counted across calls (grpc's ``maximum_concurrent_rpcs`` counts a whole call as one
    RPC), the drain switch (once draining, new streams are refused and idle calls end),
    and the streams' metrics."""

    def __init__(self, limit: int | None, metrics: FrontendMetrics | None = None) -> None:
        self.limit = limit
        self.metrics = metrics
        self.live = 0
        self.draining = False
        self._sessions: set[_MuxSession] = set()

    async def begin_drain(self) -> None:
        self.draining = True
        for session in self._sessions:
            session.wake()

    def add(self, session: _MuxSession) -> None:
        self._sessions.add(session)

    def remove(self, session: _MuxSession) -> None:
        self._sessions.discard(session)

    def count_end(self, kind: str | None, code: int) -> None:
        if self.metrics is not None:
            name = grpc_code_name(code)
            self.metrics.mux_streams.labels(kind or "none", name).inc()

    def count_batch(self, frames: int) -> None:
        if self.metrics is not None:
            self.metrics.mux_batch_frames.observe(frames)


class _MuxSession:
    """One Multiplex call: its live streams, its outbox and its writer's wake-up."""

    def __init__(self, open_stream: StreamOpener, budget: StreamBudget) -> None:
        self.open_stream = open_stream
        self.budget = budget
        self.streams: dict[int, asyncio.Task[None]] = {}
        # The next batch, built in place: a frame is copied once, into it.
        self.outbox = frontend_pb2.MuxBatch()
        self.requests_done = False
        self._ready = asyncio.Event()

    def wake(self) -> None:
        self._ready.set()

    @property
    def finished(self) -> bool:
        """Nothing more to send and nothing more will come: the call may end."""
        idle = not self.streams and not self.outbox.frames
        return idle and (self.requests_done or self.budget.draining)

    def send(self, stream_id: int, **frame: Any) -> None:
        """Queue one ``MuxFrame`` (its fields besides ``stream_id``) for the next batch."""
        self.outbox.frames.add(stream_id=stream_id, **frame)
        self._ready.set()

    def end(self, stream_id: int, status: status_pb2.Status) -> None:
        self.send(stream_id, end=status)

    async def next_batch(self) -> frontend_pb2.MuxBatch | None:
        """Everything queued since the last batch (None: the call is over)."""
        while not self.outbox.frames:
            if self.finished:
                return None
            self._ready.clear()
            await self._ready.wait()
        batch, self.outbox = self.outbox, frontend_pb2.MuxBatch()
        self.budget.count_batch(len(batch.frames))
        return batch

    def handle(self, request: frontend_pb2.MuxRequest) -> None:
        kind = request.WhichOneof("kind")
        stream_id = request.stream_id
        if kind == "cancel":
            task = self.streams.pop(stream_id, None)
            if task is not None:
                task.cancel()
            return
        refusal = self._refusal(kind, stream_id)
        if refusal is not None:
            self.end(stream_id, refusal.rich_status())
            self.budget.count_end(kind, refusal.code.value[0])
            return
        self.budget.live += 1
        task = asyncio.create_task(self._run(stream_id, request))
        self.streams[stream_id] = task
        task.add_done_callback(lambda done: self._forget(stream_id, done))

    def _refusal(self, kind: str | None, stream_id: int) -> TokenlineError | None:
        if kind not in _OPEN_KINDS:
            return InvalidArgumentError("names no request to stream", field="kind")
        if stream_id in self.streams:
            return AlreadyExistsError(f"stream {stream_id} is already open", field="stream_id")
        if self.budget.draining:
            return UnavailableError("the frontend is draining")
        if self.budget.limit is not None and self.budget.live >= self.budget.limit:
            return ResourceExhaustedError("Concurrent RPC limit exceeded!")
        return None

    def _forget(self, stream_id: int, task: asyncio.Task[None]) -> None:
        self.budget.live -= 1
        if self.streams.get(stream_id) is task:
            del self.streams[stream_id]
        self._ready.set()  # the call may be finished now

    async def _run(self, stream_id: int, request: frontend_pb2.MuxRequest) -> None:
        """Relay one stream's messages, then its end; a cancel ends it silently."""
        kind = request.WhichOneof("kind")
        status = _OK
        try:
            async with aclosing(self.open_stream(request)) as messages:
                async for message in messages:
                    self.send(stream_id, **{kind: message})
        except asyncio.CancelledError:
            self.budget.count_end(kind, grpc.StatusCode.CANCELLED.value[0])
            raise
        except Exception as exc:  # noqa: BLE001 - the stream's status, as its RPC would end
            status = status_of(exc)
        self.end(stream_id, status)
        self.budget.count_end(kind, status.code)

    async def read_requests(self, requests: AsyncIterator[frontend_pb2.MuxRequest]) -> None:
        try:
            async for request in requests:
                self.handle(request)
        finally:
            self.requests_done = True  # the client half-closed: end once streams are done
            self._ready.set()

    async def close(self) -> None:
        """The call ended (done, or the client went away): cancel what still runs, so
        each stream's generator aborts its choices upstream."""
        tasks = list(self.streams.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve_multiplexed(
    requests: AsyncIterator[frontend_pb2.MuxRequest],
    open_stream: StreamOpener,
    budget: StreamBudget,
) -> AsyncIterator[frontend_pb2.MuxBatch]:
    """Batches for one Multiplex call until the client half-closes (or the frontend
    drains) and every stream has ended; closing it cancels every stream still open."""
    session = _MuxSession(open_stream, budget)
    budget.add(session)
    reader = asyncio.create_task(session.read_requests(requests))
    try:
        while (batch := await session.next_batch()) is not None:
            yield batch
    finally:
        budget.remove(session)
        reader.cancel()
        await session.close()
        await asyncio.gather(reader, return_exceptions=True)
