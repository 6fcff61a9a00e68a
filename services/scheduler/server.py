"""Scheduler gRPC shell: translates RPCs into engine commands.

No RPC waits for an engine step: AddRequest and Abort are answered by the engine
thread's loop side (validation, the live-rid table) as soon as the command is queued.
Each step's rows reach the detokenizer through ``detokenizer_pusher.py``."""

from __future__ import annotations

import logging

from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.errors import UnavailableError, grpc_errors
from services.scheduler.engine_thread import EngineThread
from services.scheduler.protocol import req_from_pb

logger = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: EngineThread | None = None
        self.context_length = 0
        self.dtype = ""
        self.draining = False

    def attach(self, engine: EngineThread, context_length: int, dtype: str) -> None:
        """Start answering: called once the model is loaded (``dtype``: what it runs in)."""
        self.engine = engine
        self.context_length = context_length
        self.dtype = dtype

    @grpc_errors
    async def AddRequest(self, request, context):  # noqa: N802 - gRPC method name
        self._check_alive()
        if self.draining:
            raise UnavailableError("scheduler is draining; send the request to another replica")
        self.engine.add_request(req_from_pb(request))
        return scheduler_pb2.AddReqAck()

    @grpc_errors
    async def Abort(self, request, context):  # noqa: N802
        self._check_alive()
        return scheduler_pb2.AbortAck(found=self.engine.abort(request.rid, request.reason))

    @grpc_errors
    async def GetInfo(self, request, context):  # noqa: N802
        self._check_alive()
        stats = self.engine.stats
        # Waiting counts every accepted request not yet running, those still on their way
        # into the next step included: routers read it right after dispatching.
        num_waiting = max(stats.num_waiting, len(self.engine.live) - stats.num_running)
        return scheduler_pb2.SchedulerInfo(
            num_waiting=num_waiting,
            num_running=stats.num_running,
            num_free_kv_tokens=stats.num_free_kv_tokens,
            num_total_kv_tokens=stats.num_total_kv_tokens,
            num_cached_kv_tokens=stats.num_cached_kv_tokens,
            model=self.model_name,
            context_length=self.context_length,
            dtype=self.dtype,
        )

    def _check_alive(self) -> None:
        if self.engine is None:
            raise UnavailableError("scheduler is loading the model")
        if self.engine.fatal_error is not None:
            raise UnavailableError(f"engine failed: {type(self.engine.fatal_error).__name__}")


__all__ = ["SchedulerServicer"]
