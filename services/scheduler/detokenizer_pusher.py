"""Drains the engine outbox into one long-lived PushTokenBatches stream."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
from collections.abc import AsyncIterator

import grpc
from tokenline.v1 import detokenizer_pb2_grpc, scheduler_pb2

from services.scheduler.engine_thread import EngineThread
from services.scheduler.protocol import rows_to_batch_pb

logger = logging.getLogger(__name__)

_MAX_UNSENT = 8  # batches held in the loop; past this the engine thread's outbox fills


class DetokenizerPusher:
    """Sends each step's rows to the detokenizer, in order, reconnecting on failure.

    One task (the bridge) is the only reader of the engine outbox; it appends
    batches to ``_unsent``. A stream attempt yields the head of ``_unsent`` and
    removes it only when gRPC asks for the next message, and only while that
    attempt is the current one: grpc may keep pulling from a failed attempt's
    iterator, which must not consume a batch. Nothing is lost while the
    detokenizer is unreachable. A stream that breaks after it carried rows may
    have lost some in flight, and the detokenizer drops the decode state of the
    requests it opened; those requests are aborted here too, so every process
    frees them and their clients get an error instead of a hang. ``close`` ends
    the stream once everything is sent, so a draining scheduler delivers its last rows.
    """

    def __init__(self, engine: EngineThread, detokenizer_addr: str) -> None:
        self.engine = engine
        self.detokenizer_addr = detokenizer_addr
        self._task: asyncio.Task | None = None
        self._bridge: asyncio.Task | None = None
        self._unsent: collections.deque[scheduler_pb2.BatchTokenIDOutput] = collections.deque()
        self._changed = asyncio.Event()
        self._in_transit = False
        self._attempt = 0
        self._carried_rows = False
        self._step = 0
        self._closing = False

    @property
    def is_flushed(self) -> bool:
        return not self._unsent and not self._in_transit and self.engine.outbox.empty()

    def start(self) -> None:
        self._bridge = asyncio.create_task(self._move_rows(), name="outbox-bridge")
        self._task = asyncio.create_task(self._run(), name="detokenizer-pusher")

    async def close(self, timeout: float = 5.0) -> None:
        """Finish the stream after the last queued rows; cancel past ``timeout``."""
        if self._task is None or self._bridge is None:
            return
        self._closing = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            self._task.cancel()
        self._bridge.cancel()
        await asyncio.gather(self._task, self._bridge, return_exceptions=True)

    async def _move_rows(self) -> None:
        while True:
            while len(self._unsent) >= _MAX_UNSENT:
                await asyncio.sleep(0.005)
            rows = await asyncio.to_thread(self._take)
            if rows is not None:
                self._step += 1
                self._unsent.append(rows_to_batch_pb(self._step, rows))
                self._in_transit = False
                self._changed.set()

    def _take(self) -> list | None:
        """Runs on a worker thread; marks rows in transit the moment they leave the outbox."""
        try:
            rows = self.engine.outbox.get(timeout=0.2)  # bounded: no thread outlives shutdown
        except queue.Empty:
            return None
        self._in_transit = True
        return rows

    async def _run(self) -> None:
        backoff = 0.05
        while not (self._closing and self.is_flushed):
            self._attempt += 1
            self._carried_rows = False
            try:
                async with grpc.aio.insecure_channel(self.detokenizer_addr) as channel:
                    stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
                    await stub.PushTokenBatches(self._batches(self._attempt))
                    backoff = 0.05
            except grpc.aio.AioRpcError as exc:
                logger.warning("detokenizer stream ended: %s; reconnecting", exc.code())
                self._attempt += 1  # retire the failed attempt's iterator now
                if self._carried_rows:
                    self.engine.abort_started("detokenizer stream lost")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _batches(self, attempt: int) -> AsyncIterator[scheduler_pb2.BatchTokenIDOutput]:
        while attempt == self._attempt and not (self._closing and self.is_flushed):
            if not self._unsent:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=0.2)
                continue
            yield self._unsent[0]
            if attempt != self._attempt:
                return  # a retired attempt: the next one re-sends this batch
            self._unsent.popleft()
            self._carried_rows = True
