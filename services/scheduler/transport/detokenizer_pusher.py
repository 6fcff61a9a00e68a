"""Carries the engine's per-step rows onto one long-lived PushTokenBatches stream."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from tokenline.v1 import detokenizer_pb2_grpc, scheduler_pb2

from services.common.auth.cluster_token import ClusterToken
from services.common.tls import TlsSettings, open_channel
from services.scheduler.core.output_row import OutputRow
from services.scheduler.transport.proto_codec import rows_to_pb

logger = logging.getLogger(__name__)

MAX_UNSENT_STEPS = 8  # steps handed over but not yet taken by gRPC; past this the engine waits


class DetokenizerPusher:
    """Sends each step's rows to the detokenizer, in order, reconnecting on failure.

    The thread that delivers the engine's outputs calls ``publish``, which makes the
    step's rows one ``BatchTokenIDOutput`` (off the event loop), hands it to the loop
    with ``call_soon_threadsafe`` (no polling) and blocks while ``max_unsent`` steps are
    still unsent: a stalled detokenizer bounds memory and stalls the engine instead.
    On the loop the batch is numbered and appended to ``_unsent``.
    A stream attempt yields the head of ``_unsent`` and removes it only when gRPC
    asks for the next message, and only while that attempt is the current one: grpc
    may keep pulling from a failed attempt's iterator, which must not consume a batch.
    Nothing is lost while the detokenizer is unreachable. A stream that breaks after
    it carried rows may have lost some in flight, and the detokenizer drops the decode
    state of the requests it opened; ``on_stream_lost`` aborts those requests, so every
    process frees them and their clients get an error instead of a hang. ``close``
    ends the stream once everything is sent, so a draining scheduler delivers its last rows.
    """

    def __init__(
        self,
        detokenizer_addr: str,
        on_stream_lost: Callable[[str], None],
        max_unsent: int = MAX_UNSENT_STEPS,
        tls: TlsSettings | None = None,
        cluster_token: ClusterToken | None = None,
    ) -> None:
        self.detokenizer_addr = detokenizer_addr
        self.tls = tls
        self._interceptors = cluster_token.client_interceptors() if cluster_token else []
        self.on_stream_lost = on_stream_lost
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._unsent: collections.deque[scheduler_pb2.BatchTokenIDOutput] = collections.deque()
        self._room = threading.BoundedSemaphore(max_unsent)
        self._num_handed = 0  # published and not yet sent; guarded by _count_lock
        self._count_lock = threading.Lock()
        self._closed = threading.Event()
        self._changed = asyncio.Event()
        self._attempt = 0
        self._carried_rows = False
        self._step = 0
        self._closing = False

    @property
    def is_flushed(self) -> bool:
        """Every published step has been taken by the stream."""
        return self._num_handed == 0

    def start(self) -> None:
        """Begin streaming; call on the event loop before the engine thread publishes."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="detokenizer-pusher")

    def publish(self, rows: Sequence[OutputRow]) -> None:
        """Off the loop: hand one step's rows to it; waits while the stream lags."""
        if self._loop is None:
            raise RuntimeError("DetokenizerPusher.publish before start()")
        while not self._room.acquire(timeout=0.2):
            if self._closed.is_set():
                logger.warning("pusher closed; %d rows of a step not sent", len(rows))
                return
        batch = rows_to_pb(rows)
        with self._count_lock:
            self._num_handed += 1
        self._loop.call_soon_threadsafe(self._append, batch)

    async def close(self, timeout: float = 5.0) -> None:
        """Finish the stream after the last queued rows; cancel past ``timeout``."""
        if self._task is None:
            return
        self._closing = True
        self._changed.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            self._task.cancel()
        self._closed.set()
        await asyncio.gather(self._task, return_exceptions=True)

    def _append(self, batch: scheduler_pb2.BatchTokenIDOutput) -> None:
        self._step += 1
        batch.step = self._step
        self._unsent.append(batch)
        self._changed.set()

    def _sent(self) -> None:
        self._unsent.popleft()
        self._carried_rows = True
        with self._count_lock:
            self._num_handed -= 1
        self._room.release()

    async def _run(self) -> None:
        backoff = 0.05
        while not (self._closing and self.is_flushed):
            self._attempt += 1
            self._carried_rows = False
            try:
                channel = open_channel(
                    self.detokenizer_addr, self.tls, interceptors=self._interceptors
                )
                async with channel:
                    stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
                    await stub.PushTokenBatches(self._batches(self._attempt))
                    backoff = 0.05
            except grpc.aio.AioRpcError as exc:
                logger.warning("detokenizer stream ended: %s; reconnecting", exc.code())
                self._attempt += 1  # retire the failed attempt's iterator now
                if self._carried_rows:
                    self.on_stream_lost("detokenizer stream lost")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _batches(self, attempt: int) -> AsyncIterator[scheduler_pb2.BatchTokenIDOutput]:
        while attempt == self._attempt and not (self._closing and self.is_flushed):
            if not self._unsent:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=1.0)
                continue
            yield self._unsent[0]
            if attempt != self._attempt:
                return  # a retired attempt: the next one re-sends this batch
            self._sent()
