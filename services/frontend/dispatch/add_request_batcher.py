"""AddRequestBatcher: the requests a frontend dispatches to one scheduler at the same
moment go out as one ``AddRequests`` call.

Why: a burst (a tokenizer batch finishing, a client's n choices, many clients at once)
made one unary AddRequest each, and every call costs both event loops a few hundred
microseconds: on the 2-core EPYC here the 64th request of a burst waited 16-35 ms for
its turn, while one call carrying 64 requests takes about a millisecond. Each request
still gets its own answer, exactly the error its own AddRequest would have raised.

Policy: a request submitted while none is pending schedules a flush for the next turn
of the event loop, and everything submitted before then rides in that call. A lone
request pays one ``call_soon`` and no timer, so an idle server adds no latency.

Requests arriving one per turn (a gateway's streams open as separate messages, each
read in a turn of its own) would still make a call each, so at most ``max_in_flight``
calls are out at once: what is submitted while they are goes as one call when the first
of them is answered (group commit). Under a burst the batches grow by themselves; the
cost is at most one AddRequests round trip of waiting, and only while a call is out.

Every call has a deadline (``timeout_s``, by default the scheduler's own wait for its engine
plus a margin): a scheduler whose loop hangs would otherwise hold this call, and with it
every request queued behind it, forever. A call that timed out may still have been
accepted, so its requests are ended with DEADLINE_EXCEEDED and count as possibly held
(``may_have_reached``): the frontend aborts them.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.rpc import status_pb2
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.deadlines import ENGINE_ANSWER_RPC_TIMEOUT_S
from services.common.errors import call_error

logger = logging.getLogger(__name__)

_Pending = tuple[scheduler_pb2.TokenizedGenerateReqInput, "asyncio.Future[None]"]


class AddRequestBatcher:
    """Batches one scheduler's AddRequest calls; ``num_calls`` / ``num_requests`` count
    what went out (``num_requests / num_calls`` is the mean batch)."""

    def __init__(
        self,
        stub: scheduler_pb2_grpc.SchedulerServiceStub,
        max_in_flight: int = 1,
        timeout_s: float = ENGINE_ANSWER_RPC_TIMEOUT_S,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self._stub = stub
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self._pending: list[_Pending] = []
        self._calls: set[asyncio.Task] = set()
        self._flush_scheduled = False
        self.num_calls = 0
        self.num_requests = 0

    def submit(self, req: scheduler_pb2.TokenizedGenerateReqInput) -> asyncio.Future[None]:
        """A future that resolves when the scheduler accepted ``req``, or fails with the
        ``grpc.aio.AioRpcError`` its own AddRequest would have raised. The call runs on
        whether or not the caller still waits (the scheduler may hold the request)."""
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[None] = loop.create_future()
        self._pending.append((req, accepted))
        self._schedule_flush(loop)
        return accepted

    def _schedule_flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Flush at the next turn, unless one is due or every call slot is taken (then
        the first call to end flushes)."""
        if self._flush_scheduled or len(self._calls) >= self.max_in_flight:
            return
        self._flush_scheduled = True
        loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(batch))
        self._calls.add(task)
        task.add_done_callback(self._call_ended)

    def _call_ended(self, task: asyncio.Task) -> None:
        self._calls.discard(task)
        if self._pending:
            self._schedule_flush(task.get_loop())

    async def _send(self, batch: list[_Pending]) -> None:
        self.num_calls += 1
        self.num_requests += len(batch)
        try:
            ack = await self._stub.AddRequests(
                scheduler_pb2.AddReqBatch(reqs=[req for req, _ in batch]), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:  # the whole call failed: so did each request
            for _, accepted in batch:
                _settle(accepted, exc)
            return
        except BaseException as exc:
            lost = grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, details=repr(exc))
            for _, accepted in batch:
                _settle(accepted, lost)
            raise
        results = list(ack.results)
        if len(results) != len(batch):
            logger.error("AddRequests answered %d of %d requests", len(results), len(batch))
            missing = status_pb2.Status(
                code=grpc.StatusCode.INTERNAL.value[0], message="no answer for this request"
            )
            results += [missing] * (len(batch) - len(results))
        for (_, accepted), result in zip(batch, results, strict=False):
            _settle(accepted, None if result.code == 0 else call_error(result))

    async def close(self) -> None:
        """Wait for the calls in flight and those still to go (their requests may be
        held by the scheduler)."""
        while self._calls or self._pending:
            if self._calls:
                await asyncio.gather(*self._calls, return_exceptions=True)
            else:
                await asyncio.sleep(0)  # the flush already scheduled sends them


def may_have_reached(error: BaseException) -> bool:
    """Whether a request whose dispatch failed with ``error`` may still be held by the
    scheduler: its call ran out of time or was cancelled after it went out. A refusal,
    or a call the scheduler answered with an error, left nothing there."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in _UNKNOWN_OUTCOME


_UNKNOWN_OUTCOME = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


def _settle(accepted: asyncio.Future[None], error: BaseException | None) -> None:
    if accepted.done():  # cancelled by a caller that stopped waiting
        return
    if error is None:
        accepted.set_result(None)
    else:
        accepted.set_exception(error)
