"""TokenizerManager: the frontend's request lifecycle.

Makes the cluster-wide rids (``<frontend id>-<counter>``: the frontend id is unique
per process start, so no two live requests anywhere share one, whatever ids clients
send), dispatches tokenized requests to a scheduler it holds a lease on (router.py),
routes rows from the detokenizer subscription to their ReqState, and guarantees that
every ending (finish, error, client cancel, lost detokenizer or scheduler) removes
the ReqState and, when the scheduler may still hold the request, sends exactly one
AbortReq.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from tokenline.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    session_pb2,
)

from services.common.auth.api_keys import ApiKey
from services.common.auth.caller import current_caller
from services.common.auth.cluster_token import ClusterToken
from services.common.deadlines import ENGINE_ANSWER_RPC_TIMEOUT_S
from services.common.errors import SCHEDULER_STREAM_ENDED, UnavailableError
from services.common.sampling_params import SamplingParams
from services.common.tls import TlsSettings, open_channel
from services.frontend.dispatch.add_request_batcher import AddRequestBatcher, may_have_reached
from services.frontend.dispatch.key_limits import KeyLimiter
from services.frontend.dispatch.request_state import ChoiceNews, ReqStage, ReqState, ReqStateTable
from services.frontend.dispatch.router import SchedulerRouter
from services.frontend.dispatch.sessions import SessionRoutes

logger = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 5.0


@dataclass(slots=True)
class TokenizedRequest:
    """One choice of a client request, ready to dispatch."""

    rid: str  # from TokenizerManager.new_rid: the key in every process
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    times: common_pb2.StageTimes | None = None
    label: str = ""  # the client's id for this choice: echoed and logged, never a key
    stream: bool = True  # False: the client waits for the whole output (one final row)
    # In a session: sent to the replica holding it, which puts the parent's ids in front.
    session: session_pb2.SessionParams | None = None
    priority: int = 0  # the scheduler's order: higher runs first
    # Prompt logprobs from this position on (None: none), with this many alternatives.
    logprob_start_len: int | None = None
    prompt_top_logprobs_num: int = 0
    # Set: a pooling (embedding) request; nothing is sampled (max_new_tokens 0).
    pooling: scheduler_pb2.PoolingParams | None = None


class TokenizerManager:
    def __init__(
        self,
        frontend_id: str,
        scheduler_addrs: list[str],
        detokenizer_addr: str,
        # Each choice's final row, with its label and the name of the key it was made with.
        on_finished: Callable[[detokenizer_pb2.StrRow, str, str], None] | None = None,
        tls: TlsSettings | None = None,
        add_calls_in_flight: int = 1,
        add_timeout_s: float = ENGINE_ANSWER_RPC_TIMEOUT_S,
        cluster_token: ClusterToken | None = None,
    ) -> None:
        self.frontend_id = frontend_id
        self.table = ReqStateTable()
        self.limiter = KeyLimiter()
        self.num_aborts_sent = 0
        self._on_finished = on_finished
        token = cluster_token if cluster_token is not None else ClusterToken()
        interceptors = token.client_interceptors()
        self._channels = {
            addr: open_channel(addr, tls, interceptors=interceptors) for addr in scheduler_addrs
        }
        self._stubs = {
            addr: scheduler_pb2_grpc.SchedulerServiceStub(ch) for addr, ch in self._channels.items()
        }
        self._batchers = {
            addr: AddRequestBatcher(stub, add_calls_in_flight, add_timeout_s)
            for addr, stub in self._stubs.items()
        }
        self.router = SchedulerRouter(self._stubs, frontend_id, on_down=self._scheduler_down)
        self.sessions = SessionRoutes(self._stubs, self.router.pick, frontend_id)
        self._rid_counter = itertools.count()
        self.detokenizer_addr = detokenizer_addr
        self._detok_channel = open_channel(detokenizer_addr, tls, interceptors=interceptors)
        self._subscription: asyncio.Task | None = None
        self._cleanups: set[asyncio.Task] = set()
        self.subscribed = asyncio.Event()

    def new_rid(self) -> str:
        """A rid no other live request in the cluster has."""
        return f"{self.frontend_id}-{next(self._rid_counter)}"

    # ---- lifecycle of the process ----------------------------------------------

    def start(self) -> None:
        self._subscription = asyncio.create_task(self._receive_loop(), name="detok-subscription")
        self.router.start()

    async def close(self) -> None:
        await self.router.close()
        if self._subscription is not None:
            self._subscription.cancel()
            await asyncio.gather(self._subscription, return_exceptions=True)
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        for batcher in self._batchers.values():
            await batcher.close()
        for channel in [*self._channels.values(), self._detok_channel]:
            await channel.close()

    async def _receive_loop(self) -> None:
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(self._detok_channel)
        backoff = 0.05
        while True:
            try:
                # wait_for_ready: a detokenizer not listening yet (still starting, or
                # restarting) is waited for, and subscribed to the moment it is up.
                call = stub.Subscribe(
                    detokenizer_pb2.SubscribeRequest(frontend_id=self.frontend_id),
                    wait_for_ready=True,
                )
                await call.wait_for_connection()
                self.subscribed.set()
                backoff = 0.05
                async for batch in call:
                    self._route(batch)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                logger.warning("detokenizer subscription lost: %s", exc.code())
            self.subscribed.clear()
            self._fail_dispatched("detokenizer connection lost")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    @property
    def can_serve(self) -> bool:
        """A request could complete now: the detokenizer stream is up and some scheduler
        holds a live lease for this frontend."""
        return self.subscribed.is_set() and self.router.any_answering()

    def _route(self, batch: detokenizer_pb2.BatchStrOutput) -> None:
        for row in batch.rows:
            state = self.table.get(row.rid)
            if state is not None:
                state.push(row)

    def _scheduler_down(self, addr: str) -> None:
        """The lease on a replica ended: it aborts this frontend's requests there, so
        they fail now with UNAVAILABLE, and closes the sessions this frontend holds there."""
        self.sessions.drop_scheduler(addr)
        for state in self.table.live():
            if state.scheduler == addr:
                state.fail(f"scheduler {addr} is unavailable")

    def _fail_dispatched(self, message: str) -> None:
        """Rows of dispatched requests may have been lost: end them now (they get aborted)."""
        for state in self.table.live():
            state.fail(message)  # a no-op unless a scheduler may hold it

    # ---- one client request ----------------------------------------------------

    @contextlib.asynccontextmanager
    async def open(
        self, requests: list[TokenizedRequest]
    ) -> AsyncIterator[AsyncIterator[tuple[int, detokenizer_pb2.StrRow]]]:
        """Dispatch every choice, then hand out their (index, row) stream.

        A refusal (duplicate rid, overload, invalid, no scheduler) raises here, before
        the caller has sent anything, so a streaming client gets a real status instead
        of a 200 and an error frame. A row carries everything its choice produced since
        the previous one, so a slow consumer gets fewer, larger rows. A choice the
        scheduler or detokenizer aborted ends with an ``abort`` finish row carrying the
        reason; the stream raises UnavailableError when a service it needs was lost.
        Leaving the context early (client cancel) aborts the choices still running.
        The caller's key (services/common/auth/caller.py) owns the choices and is charged
        for them; over its limits, RESOURCE_EXHAUSTED comes before anything is made.
        """
        if not self.subscribed.is_set():
            raise UnavailableError("frontend is not connected to the detokenizer yet")
        key = current_caller()
        self.limiter.admit(key)
        try:
            sink = ChoiceNews(asyncio.get_running_loop())
            times = requests[0].times or common_pb2.StageTimes()
            states = self.table.create_all([r.rid for r in requests], sink, times)
        except BaseException:
            self.limiter.release(key)
            raise
        for state, req in zip(states, requests, strict=True):
            state.label, state.owner = req.label, key.name if key is not None else ""
        try:
            for state, req in zip(states, requests, strict=True):
                await self._dispatch(state, req)
            yield self._rows(states, sink, key)
        finally:
            self.limiter.release(key)
            self._release(states)

    async def generate(
        self, requests: list[TokenizedRequest]
    ) -> AsyncGenerator[tuple[int, detokenizer_pb2.StrRow], None]:
        """``open`` as one generator, for callers that send nothing before the first row."""
        async with self.open(requests) as rows:
            async for item in rows:
                yield item

    async def _rows(
        self, states: list[ReqState], sink: ChoiceNews, key: ApiKey | None
    ) -> AsyncIterator[tuple[int, detokenizer_pb2.StrRow]]:
        """(index, row) until every choice has finished."""
        remaining = len(states)
        while remaining:
            for index in await sink.take():
                state = states[index]
                row = state.take()
                if state.error is not None:
                    raise UnavailableError(state.error)
                if row.HasField("finish_reason"):
                    remaining -= 1
                    usage = row.usage
                    self.limiter.charge(key, usage.prompt_tokens + usage.completion_tokens)
                    self._finished(row, state)
                yield index, row

    def _finished(self, row: detokenizer_pb2.StrRow, state: ReqState) -> None:
        if self._on_finished is not None:
            self._on_finished(row, state.label, state.owner)
        fr = row.finish_reason
        if fr.kind == common_pb2.FinishReason.KIND_ABORT and fr.message == SCHEDULER_STREAM_ENDED:
            # A lost scheduler is a service failure the client may retry elsewhere.
            raise UnavailableError(fr.message)

    async def _dispatch(self, state: ReqState, req: TokenizedRequest) -> None:
        if req.session is not None:  # only the replica holding the session can run it
            await self._dispatch_to(self.sessions.scheduler_of(req.session.id), state, req)
            return
        try:
            await self._dispatch_to(self.router.pick(), state, req)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # It may hold the request (no retry elsewhere); route new ones around it.
                self.router.mark_down(state.scheduler)
            if exc.code() != grpc.StatusCode.UNAVAILABLE or len(self._stubs) == 1:
                raise
            # That replica is down or draining: one more try on another.
            self.router.mark_down(state.scheduler)
            await self._dispatch_to(self.router.pick(exclude=state.scheduler), state, req)

    async def _dispatch_to(self, addr: str, state: ReqState, req: TokenizedRequest) -> None:
        state.times.dispatched = time.time()
        pb = scheduler_pb2.TokenizedGenerateReqInput(
            rid=req.rid,
            input_ids=req.input_ids,
            sampling_params=req.params.to_pb(),
            logprob=common_pb2.LogprobOptions(
                return_logprob=req.return_logprob,
                top_logprobs_num=req.top_logprobs_num,
                logprob_start_len=req.logprob_start_len,
                prompt_top_logprobs_num=req.prompt_top_logprobs_num,
            ),
            reply_to=self.frontend_id,
            times=state.times,
            label=req.label,
            stream=req.stream,
            priority=req.priority,
            session_params=req.session,
            pooling=req.pooling,
        )
        state.scheduler = addr
        self.router.dispatched(addr)
        # From here the scheduler may hold the rid, even if this task is cancelled
        # while the call is in flight: the call runs on, and _release waits for it.
        # Requests dispatched together share one AddRequests call (add_request_batcher.py).
        state.stage = ReqStage.SENT
        state.dispatch_call = self._batchers[addr].submit(pb)
        try:
            await asyncio.shield(state.dispatch_call)
        except grpc.aio.AioRpcError as exc:
            self.router.refused(addr)
            if not may_have_reached(exc):  # a timed-out call stays SENT: it gets aborted
                state.stage = ReqStage.REFUSED  # nothing to abort (the rid may be another's)
            raise

    def _release(self, states: list[ReqState]) -> None:
        """Remove local state now; abort what a scheduler may still run, in the background."""
        for state in states:
            self.table.remove(state)
        if any(s.may_be_held for s in states):
            # A task of its own: this runs while the client's call is being cancelled.
            task = asyncio.create_task(self._abort_unfinished(states))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)

    async def _settle_dispatches(self, states: list[ReqState]) -> None:
        """Wait for the AddRequest calls still in flight (so an abort cannot overtake
        one), and mark the states whose call was refused: the scheduler never held them,
        and their rid is not ours to abort. A call that timed out is no refusal."""
        calls = [s.dispatch_call for s in states if s.dispatch_call and not s.dispatch_call.done()]
        if calls:
            await asyncio.wait(calls, timeout=_ABORT_TIMEOUT_S)
        for state in states:
            call = state.dispatch_call
            if call is None or not call.done() or not state.may_be_held:
                continue
            error = None if call.cancelled() else call.exception()
            if call.cancelled() or (error is not None and not may_have_reached(error)):
                state.stage = ReqStage.REFUSED

    async def _abort_unfinished(self, states: list[ReqState]) -> None:
        await self._settle_dispatches(states)
        for state in states:
            if state.may_be_held:
                state.stage = ReqStage.ABORTED  # at most one AbortReq
                await self._send_abort(state)

    async def _send_abort(self, state: ReqState, reason: str = "client cancelled") -> None:
        self.num_aborts_sent += 1
        try:
            await self._stubs[state.scheduler].Abort(
                scheduler_pb2.AbortReq(rid=state.rid, reason=reason),
                timeout=_ABORT_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning("abort rid=%s failed: %s", state.rid, exc.code())

    async def abort_live(self, states: list[ReqState], reason: str) -> int:
        """Have each live request's scheduler abort it (an operator's abort, not a client
        leaving): the scheduler ends it with a final ``abort`` row carrying ``reason``, so
        its stream ends as any abort does and its state is released on the normal path.
        Waits for an AddRequest still in flight, so the abort cannot overtake it.
        Returns how many AbortReq were sent."""
        held = [s for s in states if s.may_be_held]
        await self._settle_dispatches(held)
        held = [s for s in held if s.may_be_held]  # a refused one was never held
        await asyncio.gather(*(self._send_abort(s, reason) for s in held))
        return len(held)

    @property
    def schedulers(self) -> dict[str, scheduler_pb2_grpc.SchedulerServiceStub]:
        """Each replica's stub by address, for the operator RPCs that fan out."""
        return dict(self._stubs)

    async def detokenizer_info(self) -> detokenizer_pb2.DetokenizerInfo:
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(self._detok_channel)
        return await stub.GetInfo(detokenizer_pb2.DetokenizerInfoRequest(), timeout=5)

    async def scheduler_info(self) -> list[scheduler_pb2.SchedulerInfo]:
        return [
            await stub.GetInfo(scheduler_pb2.ServerInfoRequest(), timeout=5)
            for stub in self._stubs.values()
        ]
