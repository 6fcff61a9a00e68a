"""Scheduler gRPC shell: translates RPCs into engine commands.

No RPC waits for an engine step: AddRequest and Abort are answered by the engine
thread's loop side (validation, the live-rid table) as soon as the command is queued.
Each step's rows reach the detokenizer through ``detokenizer_pusher.py``. Requests
are tied to the frontend that sent them through its ``Attach`` lease (leases.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence
from typing import TypeVar

import grpc
from google.rpc import status_pb2
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.deadlines import ENGINE_ANSWER_TIMEOUT_S
from services.common.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    TokenlineError,
    UnavailableError,
    grpc_errors,
)
from services.scheduler.core.commands import (
    AbortOwnedCommand,
    CloseSessionCommand,
    FlushCommand,
    OpenSessionCommand,
)
from services.scheduler.transport.engine_client import EngineClient
from services.scheduler.transport.leases import Leases
from services.scheduler.transport.proto_codec import req_from_pb

logger = logging.getLogger(__name__)

# How often a lease carries the scheduler's load; frontends give up on a lease that
# stays silent for several beats.
BEAT_INTERVAL_S = 0.25
# A lease the frontend has not renewed for this long has lapsed (it renews every 250 ms).
LEASE_TIMEOUT_S = 2.0

T = TypeVar("T")

_ACCEPTED = status_pb2.Status()  # code 0: OK


async def _engine_answer(done: concurrent.futures.Future[T], what: str) -> T:
    """Wait for the engine thread to apply a command, without blocking the loop. Shielded:
    a cancelled RPC leaves the future to the engine, which still applies the command."""
    try:
        answer = asyncio.shield(asyncio.wrap_future(done))
        return await asyncio.wait_for(answer, ENGINE_ANSWER_TIMEOUT_S)
    except TimeoutError:
        raise UnavailableError(f"the engine did not answer {what} in time") from None


async def _until_renewals_stop(context: grpc.aio.ServicerContext) -> str:
    """Read the frontend's renewals until they end or stop coming; returns why."""
    while True:
        try:
            renewal = await asyncio.wait_for(context.read(), LEASE_TIMEOUT_S)
        except TimeoutError:
            return f"lease not renewed for {LEASE_TIMEOUT_S:.1f}s"
        if renewal is grpc.aio.EOF:
            return "lease closed"


def _take_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(
        self, model_name: str, metrics_port: int = 0, architecture: str = "", model_impl: str = ""
    ) -> None:
        self.model_name = model_name
        self.metrics_port = metrics_port
        self.architecture = architecture  # what GetInfo reports: the checkpoint's class
        self.model_impl = model_impl  # and the path that serves it: native or transformers
        self.engine: EngineClient | None = None
        self._serving = asyncio.Event()  # set by attach(): the model is loaded
        self.context_length = 0
        self.dtype = ""
        self.leases = Leases()
        self._owner_aborts: set[asyncio.Task] = set()

    def attach(self, engine: EngineClient, context_length: int, dtype: str) -> None:
        """Start answering: called once the model is loaded (``dtype``: what it runs in)."""
        self.engine = engine
        self.context_length = context_length
        self.dtype = dtype
        self._serving.set()

    @grpc_errors
    async def AddRequest(self, request, context):  # noqa: N802 - gRPC method name
        done = self._accept(request)
        if done is not None:  # a request in a session: the engine's verdict is the answer
            await _engine_answer(done, "the session request")
        self._count_accepted(request.reply_to)
        return scheduler_pb2.AddReqAck()

    @grpc_errors
    async def AddRequests(self, request, context):  # noqa: N802
        self._live_engine()  # not serving yet: the whole call fails, as AddRequest would
        return scheduler_pb2.AddReqBatchAck(results=await self._accept_all(request.reqs))

    async def _accept_all(
        self, reqs: Sequence[scheduler_pb2.TokenizedGenerateReqInput]
    ) -> list[status_pb2.Status]:
        """Each request as AddRequest would take it, in order, all queued before any
        session verdict is awaited; a refusal is that request's result, not the call's."""
        results: list[status_pb2.Status | None] = [None] * len(reqs)
        verdicts: dict[int, concurrent.futures.Future[None]] = {}
        for i, pb in enumerate(reqs):
            try:
                done = self._accept(pb)
            except TokenlineError as exc:
                results[i] = exc.rich_status()
                continue
            if done is not None:
                verdicts[i] = done
        for i, done in verdicts.items():
            try:
                await _engine_answer(done, "the session request")
            except TokenlineError as exc:
                results[i] = exc.rich_status()
        for pb, result in zip(reqs, results, strict=True):
            if result is None:
                self._count_accepted(pb.reply_to)
        return [result or _ACCEPTED for result in results]

    def _accept(
        self, request: scheduler_pb2.TokenizedGenerateReqInput
    ) -> concurrent.futures.Future[None] | None:
        """Queue one request or raise why not; a request in a session returns the future
        of the engine's verdict."""
        engine = self._live_engine()
        self._check_lease(request.reply_to)
        return engine.add_request(req_from_pb(request))

    def _count_accepted(self, owner: str) -> None:
        if self.leases.holds(owner):  # it may have ended while the engine answered
            self.leases.count_accepted(owner)

    @grpc_errors
    async def OpenSession(self, request, context):  # noqa: N802
        """A session lives no longer than its owner's lease (closed with its requests)."""
        engine = self._live_engine()
        self._check_lease(request.owner)
        command = OpenSessionCommand(request.session_id, request.capacity_of_str_len, request.owner)
        await _engine_answer(engine.ask(command), "the session open")
        return scheduler_pb2.SessionAck()

    @grpc_errors
    async def CloseSession(self, request, context):  # noqa: N802
        done = self._live_engine().ask(CloseSessionCommand(request.session_id))
        await _engine_answer(done, "the session close")
        return scheduler_pb2.SessionAck()

    @grpc_errors
    async def Abort(self, request, context):  # noqa: N802
        found = self._live_engine().abort(request.rid, request.reason)
        return scheduler_pb2.AbortAck(found=found)

    @grpc_errors
    async def GetInfo(self, request, context):  # noqa: N802
        return self._info(self._live_engine())

    @grpc_errors
    async def FlushCache(self, request, context):  # noqa: N802
        """Answered by the engine thread between steps; never touches engine state here."""
        outcome = await _engine_answer(self._live_engine().ask(FlushCommand()), "the flush")
        return scheduler_pb2.FlushCacheResult(
            flushed=outcome.flushed,
            num_running=outcome.num_running,
            num_waiting=outcome.num_waiting,
            reason=outcome.reason,
        )

    @grpc_errors
    async def Attach(self, request_iterator, context):  # noqa: N802
        """The frontend's lease: beats with the load while the frontend renews it; when
        the stream ends or the renewals stop for ``LEASE_TIMEOUT_S``, every request that
        frontend sent is aborted (unless it holds another stream).

        A coroutine, not a generator: cancellation (the frontend's connection ended)
        lands in this frame, so the ``finally`` runs at once. Renewals, not keepalive
        pings, catch a frozen or partitioned frontend: the beats written to it keep the
        connection looking busy, which defers gRPC's pings."""
        # A frontend that attaches while the model loads gets its first beat the moment
        # the engine is up, rather than a refusal to retry after.
        await self._serving.wait()
        engine = self._live_engine()
        first = await context.read()
        owner = "" if first is grpc.aio.EOF else first.frontend_id
        if not owner:
            raise InvalidArgumentError("must be non-empty", field="frontend_id")
        self.leases.open(owner)
        logger.info("frontend %s attached", owner)
        renewals = asyncio.ensure_future(_until_renewals_stop(context))
        try:
            while not renewals.done():
                beat = scheduler_pb2.SchedulerBeat(
                    info=self._info(engine), num_accepted=self.leases.num_accepted(owner)
                )
                await context.write(beat)
                await asyncio.wait([renewals], timeout=BEAT_INTERVAL_S)
            logger.warning("frontend %s: %s", owner, renewals.result())
        finally:
            renewals.cancel()
            # At shutdown its read can fail before the cancel lands: take the error, so
            # asyncio does not log "Task exception was never retrieved" as the server stops.
            renewals.add_done_callback(_take_outcome)
            if self.leases.close(owner):
                logger.info("frontend %s detached; aborting its requests", owner)
                self._abort_owned(engine, owner)

    def _abort_owned(self, engine: EngineClient, owner: str) -> None:
        """Synchronous when the inbox has room; otherwise retried until it has, since a
        lost abort would leave the requests running for nobody."""
        command = AbortOwnedCommand(owner, f"frontend {owner} went away")
        try:
            engine.tell(command)
        except ResourceExhaustedError:
            retry = self._retry_abort_owned(engine, command)
            task = asyncio.get_running_loop().create_task(retry)
            self._owner_aborts.add(task)
            task.add_done_callback(self._owner_aborts.discard)

    @staticmethod
    async def _retry_abort_owned(engine: EngineClient, command: AbortOwnedCommand) -> None:
        while True:
            await asyncio.sleep(0.05)
            try:
                engine.tell(command)
                return
            except ResourceExhaustedError:
                continue

    def _info(self, engine: EngineClient) -> scheduler_pb2.SchedulerInfo:
        stats = engine.stats
        # Waiting counts every accepted request not yet running, those still on their way
        # into the next step included: routers read it right after dispatching.
        num_waiting = max(stats.num_waiting, len(engine.live) - stats.num_running)
        return scheduler_pb2.SchedulerInfo(
            num_waiting=num_waiting,
            num_running=stats.num_running,
            num_free_kv_tokens=stats.num_free_kv_tokens,
            num_total_kv_tokens=stats.num_total_kv_tokens,
            num_cached_kv_tokens=stats.num_cached_kv_tokens,
            model=self.model_name,
            context_length=self.context_length,
            dtype=self.dtype,
            num_frontends=len(self.leases),
            num_sessions=stats.num_sessions,
            num_evictable_kv_tokens=stats.num_evictable_kv_tokens,
            metrics_port=self.metrics_port,
            architecture=self.architecture,
            model_impl=self.model_impl,
            runner=engine.limits.runner,
            hidden_size=engine.limits.hidden_size,
        )

    def _check_lease(self, owner: str) -> None:
        if not self.leases.holds(owner):
            raise UnavailableError(f"frontend {owner!r} holds no lease here; Attach first")

    def _live_engine(self) -> EngineClient:
        """The engine, or UNAVAILABLE while the model loads or after the engine failed."""
        if self.engine is None:
            raise UnavailableError("scheduler is loading the model")
        if self.engine.fatal_error is not None:
            raise UnavailableError(f"engine failed: {type(self.engine.fatal_error).__name__}")
        return self.engine


__all__ = ["SchedulerServicer"]
