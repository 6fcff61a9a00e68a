"""The gateway's side of ``FrontendService.Multiplex``: every SSE stream over one gRPC call.

A per-request server stream costs the gateway a gRPC read per token of every request;
here one read brings a ``MuxBatch`` with a step's frames for all of them, and each
frame goes to its stream's ``MuxStream`` without a read of its own. A ``MuxStream``
reads like the per-request call it replaces (``read()`` → message or
``grpc.aio.EOF``, ``cancel()``), and fails the way that call would have: its ``end``
status becomes the same ``AioRpcError``, its deadline the same DEADLINE_EXCEEDED,
and a lost Multiplex call the call's own error (UNAVAILABLE when the frontend went
away). The call opens on first use and again after it ends.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.rpc import status_pb2
from tokenline.v1 import frontend_pb2, frontend_pb2_grpc

from services.common.errors import call_error

logger = logging.getLogger(__name__)

_DEADLINE = status_pb2.Status(
    code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message="Deadline Exceeded"
)
_ENDED = status_pb2.Status(
    code=grpc.StatusCode.UNAVAILABLE.value[0], message="the frontend ended the stream"
)
# What a stream's queue holds: its messages, then its end (a status or a call's error).
_Item = Any


class MuxStream:
    """One multiplexed stream, read like a ``grpc.aio.UnaryStreamCall``."""

    __slots__ = ("_mux", "_items", "_loop", "_waiter", "_timer", "stream_id", "done")

    def __init__(self, mux: FrontendMux, stream_id: int, timeout_s: float | None) -> None:
        self._mux = mux
        self._items: collections.deque[_Item] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self.stream_id = stream_id
        self.done = False  # its end arrived, or it was cancelled
        # Kept: looking the loop up costs a getpid system call (Python 3.11), per token here.
        self._loop = loop = asyncio.get_running_loop()
        self._timer = None if timeout_s is None else loop.call_later(timeout_s, self._expire)

    def deliver(self, item: _Item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self) -> Any:
        """The next message; ``grpc.aio.EOF`` after a clean end; an end's error raised."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, status_pb2.Status):
            self._finish()
            if item.code == 0:
                return grpc.aio.EOF
            raise call_error(item)
        if isinstance(item, grpc.aio.AioRpcError):
            self._finish()
            raise item
        return item

    def cancel(self) -> bool:
        """Stop the stream: the frontend aborts its choices upstream. Idempotent."""
        if self.done:
            return False
        self._finish()
        self._mux.cancel(self.stream_id)
        return True

    def _expire(self) -> None:
        """The request's deadline, as the per-request call's would have fired."""
        if not self.done:
            self._mux.cancel(self.stream_id)
            self.deliver(_DEADLINE)

    def _finish(self) -> None:
        self.done = True
        if self._timer is not None:
            self._timer.cancel()


class FrontendMux:
    """The gateway's one Multiplex call: opens streams on it, routes frames back."""

    def __init__(self, stub: frontend_pb2_grpc.FrontendServiceStub, timeout_s: float | None):
        self._stub = stub
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._streams: dict[int, MuxStream] = {}
        self._call: grpc.aio.StreamStreamCall | None = None
        # Each call gets its own queue (``_connect``); this one only types the attribute
        # until the first: nothing is put in it, since a stream opens only on a call.
        self._outgoing: asyncio.Queue[frontend_pb2.MuxRequest | None] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None

    def open(self, kind: str, request: Any, caller: str = "") -> MuxStream:
        """Start streaming ``request`` (``kind``: "chat" or "completion") for the API key
        named ``caller`` ("": the call's own)."""
        if self._call is None:
            self._connect()
        stream = MuxStream(self, next(self._ids), self._timeout_s)
        self._streams[stream.stream_id] = stream
        self._outgoing.put_nowait(
            frontend_pb2.MuxRequest(stream_id=stream.stream_id, caller=caller, **{kind: request})
        )
        return stream

    def cancel(self, stream_id: int) -> None:
        if self._streams.pop(stream_id, None) is not None:
            self._outgoing.put_nowait(frontend_pb2.MuxRequest(stream_id=stream_id, cancel=True))

    async def close(self) -> None:
        """At shutdown: fail what is still open and end the call."""
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    def _connect(self) -> None:
        outgoing: asyncio.Queue[frontend_pb2.MuxRequest | None] = asyncio.Queue()
        self._outgoing = outgoing
        call = self._stub.Multiplex(_drain(outgoing))
        self._call = call
        self._reader = asyncio.create_task(self._read(call, outgoing))

    async def _read(
        self,
        call: grpc.aio.StreamStreamCall,
        outgoing: asyncio.Queue[frontend_pb2.MuxRequest | None],
    ) -> None:
        """Route every frame to its stream until the call ends, then fail the streams
        still open on it with the call's error: none of them can hear more."""
        error: Any = _ENDED
        try:
            async for batch in call:
                for frame in batch.frames:
                    self._route(frame)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            pass
        finally:
            # No await from here on: a stream opened now goes on the next call.
            if self._call is call:
                self._call = None
            outgoing.put_nowait(None)
            orphans, self._streams = self._streams, {}
            for stream in orphans.values():
                stream.deliver(error)
            if orphans:
                logger.warning("multiplexed call ended with %d streams open", len(orphans))

    def _route(self, frame: frontend_pb2.MuxFrame) -> None:
        kind = frame.WhichOneof("kind")
        if kind == "end":
            stream = self._streams.pop(frame.stream_id, None)
            if stream is not None:
                stream.deliver(frame.end)
            return
        stream = self._streams.get(frame.stream_id)
        if stream is not None:  # else: cancelled here, its frames were in flight
            stream.deliver(getattr(frame, kind))


async def _drain(
    outgoing: asyncio.Queue[frontend_pb2.MuxRequest | None],
) -> AsyncIterator[frontend_pb2.MuxRequest]:
    """The call's request side: opens and cancels in the order they were made."""
    while (request := await outgoing.get()) is not None:
        yield request
