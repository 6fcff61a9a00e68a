"""Scheduler gRPC shell: translates RPCs into engine commands.

Each step's rows reach the detokenizer through ``detokenizer_pusher.py``."""

from __future__ import annotations

import asyncio
import logging

from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.errors import UnavailableError, grpc_errors
from services.scheduler.engine_thread import AbortCommand, AddCommand, EngineThread
from services.scheduler.protocol import req_from_pb

logger = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: EngineThread | None = None
        self.context_length = 0
        self.draining = False

    def attach(self, engine: EngineThread, context_length: int) -> None:
        """Start answering: called once the model is loaded."""
        self.engine = engine
        self.context_length = context_length

    @grpc_errors
    async def AddRequest(self, request, context):  # noqa: N802 - gRPC method name
        self._check_alive()
        if self.draining:
            raise UnavailableError("scheduler is draining; send the request to another replica")
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
            num_cached_kv_tokens=stats.num_cached_kv_tokens,
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


def _resolve(future: asyncio.Future, result: object) -> None:
    if not future.done():
        future.set_result(result)


__all__ = ["SchedulerServicer"]
