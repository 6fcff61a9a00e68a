"""TokenizerManager: the frontend's request lifecycle.

Dispatches tokenized requests to a scheduler, receives their rows from the
detokenizer subscription, and guarantees that every ending (finish, error,
client cancel) removes the ReqState and, if the scheduler may still hold the
request, sends exactly one AbortReq.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from tokenline.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

from services.common.errors import RequestAbortedError, UnavailableError
from services.common.sampling_params import SamplingParams
from services.frontend.request_state import ReqState, ReqStateTable

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenizedRequest:
    """One choice of a client request, ready to dispatch."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    times: common_pb2.StageTimes | None = None


class TokenizerManager:
    def __init__(self, frontend_id: str, scheduler_addrs: list[str], detokenizer_addr: str) -> None:
        self.frontend_id = frontend_id
        self.table = ReqStateTable()
        self._channels = {addr: grpc.aio.insecure_channel(addr) for addr in scheduler_addrs}
        self._stubs = {
            addr: scheduler_pb2_grpc.SchedulerServiceStub(ch) for addr, ch in self._channels.items()
        }
        self._round_robin = itertools.cycle(scheduler_addrs)
        self._detok_channel = grpc.aio.insecure_channel(detokenizer_addr)
        self._subscription: asyncio.Task | None = None
        self.subscribed = asyncio.Event()

    # ---- lifecycle of the process ----------------------------------------------

    def start(self) -> None:
        self._subscription = asyncio.create_task(self._receive_loop(), name="detok-subscription")

    async def close(self) -> None:
        if self._subscription is not None:
            self._subscription.cancel()
            await asyncio.gather(self._subscription, return_exceptions=True)
        for channel in [*self._channels.values(), self._detok_channel]:
            await channel.close()

    async def _receive_loop(self) -> None:
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(self._detok_channel)
        backoff = 0.05
        while True:
            try:
                call = stub.Subscribe(
                    detokenizer_pb2.SubscribeRequest(frontend_id=self.frontend_id)
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

    def _route(self, batch: detokenizer_pb2.BatchStrOutput) -> None:
        for row in batch.rows:
            state = self.table.get(row.rid)
            if state is not None:
                state.sink.put_nowait((state.index, row))

    def _fail_dispatched(self, message: str) -> None:
        """Rows of dispatched requests may be lost: end them with an error now."""
        for state in self.table.live():
            if state.dispatched and not state.finished:
                row = detokenizer_pb2.StrRow(
                    rid=state.rid,
                    finish_reason=common_pb2.FinishReason(
                        kind=common_pb2.FinishReason.KIND_ABORT, message=message
                    ),
                )
                state.sink.put_nowait((state.index, row))

    # ---- one client request ----------------------------------------------------

    async def generate(
        self, requests: list[TokenizedRequest]
    ) -> AsyncIterator[tuple[int, detokenizer_pb2.StrRow]]:
        """Dispatch every choice and yield (index, row) until all have finished."""
        if not self.subscribed.is_set():
            raise UnavailableError("frontend is not connected to the detokenizer yet")
        sink: asyncio.Queue[tuple[int, detokenizer_pb2.StrRow]] = asyncio.Queue()
        states: list[ReqState] = []
        try:
            for i, req in enumerate(requests):
                states.append(self.table.create(req.rid, i, sink))
            for state, req in zip(states, requests, strict=True):
                await self._dispatch(state, req)
            remaining = len(states)
            while remaining:
                index, row = await sink.get()
                if row.HasField("finish_reason"):
                    states[index].finished = True
                    remaining -= 1
                    if row.finish_reason.kind == common_pb2.FinishReason.KIND_ABORT:
                        raise RequestAbortedError(row.finish_reason.message or "request aborted")
                yield index, row
        finally:
            await self._release(states)

    async def _dispatch(self, state: ReqState, req: TokenizedRequest) -> None:
        addr = next(self._round_robin)
        times = req.times or common_pb2.StageTimes()
        times.dispatched = time.time()
        pb = scheduler_pb2.TokenizedGenerateReqInput(
            rid=req.rid,
            input_ids=req.input_ids,
            sampling_params=req.params.to_pb(),
            logprob=common_pb2.LogprobOptions(
                return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num
            ),
            reply_to=self.frontend_id,
            times=times,
        )
        state.scheduler = addr
        await self._stubs[addr].AddRequest(pb)
        state.dispatched = True

    async def _release(self, states: list[ReqState]) -> None:
        """Remove local state; abort what the scheduler may still be running."""
        for state in states:
            self.table.remove(state.rid)
        pending = [s for s in states if s.dispatched and not s.finished and not s.abort_sent]
        for state in pending:
            state.abort_sent = True
        if pending:
            # Shielded: this runs while the client's call is being cancelled.
            await asyncio.shield(self._send_aborts(pending))

    async def _send_aborts(self, states: list[ReqState]) -> None:
        for state in states:
            try:
                await self._stubs[state.scheduler].Abort(
                    scheduler_pb2.AbortReq(rid=state.rid, reason="client cancelled"), timeout=5
                )
            except grpc.aio.AioRpcError as exc:
                logger.warning("abort rid=%s failed: %s", state.rid, exc.code())

    async def scheduler_info(self) -> list[scheduler_pb2.SchedulerInfo]:
        return [
            await stub.GetInfo(scheduler_pb2.ServerInfoRequest(), timeout=5)
            for stub in self._stubs.values()
        ]
