"""Scheduler gRPC shell: translates RPCs into engine commands and pushes each
step's rows to the detokenizer over one long-lived client stream."""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import AsyncIterator

import grpc
from tokenline.v1 import detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from services.common.errors import TokenlineError, UnavailableError, grpc_errors
from services.scheduler.engine_thread import AbortCommand, AddCommand, EngineThread
from services.scheduler.protocol import req_from_pb, rows_to_batch_pb

logger = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: EngineThread | None = None
        self.context_length = 0

    def attach(self, engine: EngineThread, context_length: int) -> None:
        """Start answering: called once the model is loaded."""
        self.engine = engine
        self.context_length = context_length

    @grpc_errors
    async def AddRequest(self, request, context):  # noqa: N802 - gRPC method name
        self._check_alive()
        error = await self._call(lambda done: AddCommand(req_from_pb(request), done))
        if error is not None:
            raise error
        return scheduler_pb2.AddReqAck()

    @grpc_errors
    async def Abort(self, request, context):  # noqa: N802
        self._check_alive()
        found = await self._call(lambda done: AbortCommand(request.rid, request.reason, done))
        return scheduler_pb2.AbortAck(found=found)

    @grpc_errors
    async def GetInfo(self, request, context):  # noqa: N802
        self._check_alive()
        stats = self.engine.stats
        return scheduler_pb2.SchedulerInfo(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_free_kv_tokens=stats.num_free_kv_tokens,
            num_total_kv_tokens=stats.num_total_kv_tokens,
            model=self.model_name,
            context_length=self.context_length,
        )

    async def _call(self, make_command):
        """Hand a command to the engine thread and await its answer."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def done(result: object) -> None:
            loop.call_soon_threadsafe(_resolve, future, result)

        self.engine.submit(make_command(done))
        return await future

    def _check_alive(self) -> None:
        if self.engine is None:
            raise UnavailableError("scheduler is loading the model")
        if self.engine.fatal_error is not None:
            raise UnavailableError(f"engine failed: {type(self.engine.fatal_error).__name__}")


def _get_or_none(q: queue.Queue, timeout: float = 0.2):
    # A bounded wait, so no executor thread stays blocked after shutdown.
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return None


def _resolve(future: asyncio.Future, result: object) -> None:
    if not future.done():
        future.set_result(result)


class DetokenizerPusher:
    """Drains the engine outbox into PushTokenBatches, reconnecting on failure.

    Rows wait in the bounded outbox while the detokenizer is unreachable, so
    the engine slows down rather than dropping output.
    """

    def __init__(self, engine: EngineThread, detokenizer_addr: str) -> None:
        self.engine = engine
        self.detokenizer_addr = detokenizer_addr
        self._task: asyncio.Task | None = None
        self._step = 0
        self._pending = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="detokenizer-pusher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                async with grpc.aio.insecure_channel(self.detokenizer_addr) as channel:
                    stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
                    await stub.PushTokenBatches(self._batches())
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                logger.warning("detokenizer stream ended: %s; reconnecting", exc.code())
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _batches(self) -> AsyncIterator[scheduler_pb2.BatchTokenIDOutput]:
        while True:
            if self._pending is None:
                rows = await asyncio.to_thread(_get_or_none, self.engine.outbox)
                if rows is None:
                    continue
                self._step += 1
                self._pending = rows_to_batch_pb(self._step, rows)
            batch, self._pending = self._pending, None
            yield batch


__all__ = ["SchedulerServicer", "DetokenizerPusher", "TokenlineError"]
