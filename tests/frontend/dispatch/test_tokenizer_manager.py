"""TokenizerManager's request lifecycle against fakes of the two services below it.

FakeScheduler and FakeDetokenizer are real grpc.aio servers on loopback ports
that record what the manager sends and play rows back on command, so every
ending can be staged at an exact moment. The real services are exercised by
tests/frontend/test_server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import status_pb2
from tokenline.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

from services.common.errors import AlreadyExistsError, UnavailableError, field_of
from services.common.sampling_params import SamplingParams
from services.frontend.dispatch.request_state import ReqStage
from services.frontend.dispatch.tokenizer_manager import TokenizedRequest, TokenizerManager
from tests.waiting import eventually


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.received: list[str] = []  # rids whose AddRequest arrived, answered or not
        self.num_add_calls = 0  # AddRequests calls (each carries one or more requests)
        self.add_delay = 0.0
        self.refuse: set[str] = set()
        self.on_add = None
        self.lease_ended = asyncio.Event()  # set it to end the manager's lease

    async def Attach(self, request_iterator, context):  # noqa: N802
        await context.read()  # the lease opens; renewals are not checked here
        while not self.lease_ended.is_set():
            await context.write(scheduler_pb2.SchedulerBeat(info=scheduler_pb2.SchedulerInfo()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lease_ended.wait(), 0.05)

    async def AddRequests(self, request, context):  # noqa: N802
        """Each request answered on its own, as the real scheduler does."""
        self.num_add_calls += 1
        return scheduler_pb2.AddReqBatchAck(results=[await self._add(r) for r in request.reqs])

    async def _add(self, request: scheduler_pb2.TokenizedGenerateReqInput) -> status_pb2.Status:
        self.received.append(request.rid)
        await asyncio.sleep(self.add_delay)
        if request.rid in self.refuse:
            return AlreadyExistsError("in flight elsewhere", field="rid").rich_status()
        self.events.append(("add", request.rid))
        if self.on_add is not None:
            await self.on_add(request)
        return status_pb2.Status()

    async def Abort(self, request, context):  # noqa: N802
        self.events.append(("abort", request.rid))
        return scheduler_pb2.AbortAck(found=True)

    def aborts(self) -> list[str]:
        return [rid for kind, rid in self.events if kind == "abort"]


class FakeDetokenizer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self) -> None:
        self.queue: asyncio.Queue[detokenizer_pb2.BatchStrOutput | None] = asyncio.Queue()

    async def Subscribe(self, request, context):  # noqa: N802
        await context.send_initial_metadata(())
        while True:
            batch = await self.queue.get()
            if batch is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "detokenizer going away")
            yield batch

    def send(self, rid: str, text: str, final: bool = False) -> None:
        row = detokenizer_pb2.StrRow(rid=rid, text=text, output_ids=[len(text)])
        if final:
            row.finish_reason.kind = common_pb2.FinishReason.KIND_STOP
        self.queue.put_nowait(detokenizer_pb2.BatchStrOutput(rows=[row]))


class Harness:
    def __init__(self, **manager_kwargs: float) -> None:
        self.scheduler = FakeScheduler()
        self.detokenizer = FakeDetokenizer()
        self.server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(self.scheduler, self.server)
        detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(self.detokenizer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        addr = f"127.0.0.1:{self.port}"
        self.manager = TokenizerManager("fe-test", [addr], addr, **manager_kwargs)

    async def consume(self, *rids: str) -> list[tuple[int, detokenizer_pb2.StrRow]]:
        reqs = [TokenizedRequest(rid, [5, 6, 7], SamplingParams(max_new_tokens=8)) for rid in rids]
        return [item async for item in self.manager.generate(reqs)]

    def stage(self, rid: str) -> ReqStage | None:
        state = self.manager.table.get(rid)
        return None if state is None else state.stage

    async def rows_routed(self) -> None:
        """Return once every row sent so far has been routed: a marker request's final
        row travels behind them on the same ordered subscription stream."""
        rid = f"marker-{len(self.scheduler.received)}"
        marker = asyncio.create_task(self.consume(rid))
        await added(self, rid)
        self.detokenizer.send(rid, "", final=True)
        await marker

    async def settled(self) -> None:
        """Close the manager: close waits for every AbortReq it still had to send, so
        what the scheduler recorded afterwards is final."""
        await self.manager.close()


@contextlib.asynccontextmanager
async def running(**manager_kwargs: float) -> AsyncIterator[Harness]:
    h = Harness(**manager_kwargs)
    await h.server.start()
    h.manager.start()
    await eventually(lambda: h.manager.can_serve, timeout=10)  # subscribed and leased
    try:
        yield h
    finally:
        await h.manager.close()
        await h.server.stop(None)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with running() as h:
        yield h


async def added(h: Harness, rid: str) -> None:
    await eventually(lambda: ("add", rid) in h.scheduler.events)


async def test_a_finished_request_leaves_no_state_and_sends_no_abort(harness: Harness) -> None:
    async def play(request: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        harness.detokenizer.send(request.rid, "he")
        harness.detokenizer.send(request.rid, "llo", final=True)

    harness.scheduler.on_add = play
    rows = await harness.consume("r1")
    assert "".join(r.text for _, r in rows) == "hello"
    assert rows[-1][1].HasField("finish_reason")
    assert len(harness.manager.table) == 0
    await harness.settled()
    assert harness.scheduler.aborts() == []


async def test_a_consumer_that_is_behind_gets_one_coalesced_row(harness: Harness) -> None:
    async def play(request: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        for piece in ["a", "b", "c", "d"]:
            harness.detokenizer.send(request.rid, piece)
        harness.detokenizer.send(request.rid, "e", final=True)
        # Every row is routed before the consumer looks (it starts once this returns).
        await eventually(lambda: harness.stage(request.rid) is ReqStage.FINISHED)

    harness.scheduler.on_add = play
    rows = await harness.consume("r1")
    assert len(rows) == 1
    assert rows[0][1].text == "abcde" and list(rows[0][1].output_ids) == [1] * 5
    assert rows[0][1].HasField("finish_reason")


async def test_cancel_while_receiving_sends_exactly_one_abort(harness: Harness) -> None:
    task = asyncio.create_task(harness.consume("r1"))
    await added(harness, "r1")
    harness.detokenizer.send("r1", "partial")
    await eventually(lambda: harness.stage("r1") is ReqStage.RECEIVING)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await eventually(lambda: harness.scheduler.aborts() == ["r1"])
    harness.detokenizer.send("r1", "late", final=True)  # rows after the cancel change nothing
    await harness.rows_routed()
    await harness.settled()
    assert harness.scheduler.aborts() == ["r1"] and harness.manager.num_aborts_sent == 1
    assert len(harness.manager.table) == 0


async def test_cancel_while_the_add_is_in_flight_aborts_after_it_lands(harness: Harness) -> None:
    harness.scheduler.add_delay = 0.4
    task = asyncio.create_task(harness.consume("r1"))
    await eventually(lambda: "r1" in harness.scheduler.received)  # not answered yet
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(harness.manager.table) == 0
    await eventually(lambda: harness.scheduler.aborts() == ["r1"])
    assert harness.scheduler.events == [("add", "r1"), ("abort", "r1")]


async def test_an_add_past_its_deadline_fails_the_request_and_aborts_it() -> None:
    """A scheduler that does not answer in time may still have taken the request: the
    client hears DEADLINE_EXCEEDED at once, the replica is routed around for a while, and
    the scheduler gets the abort."""
    async with running(add_timeout_s=0.2) as h:
        h.scheduler.add_delay = 1.0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.consume("r1")
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(h.manager.table) == 0
        assert not h.manager.router.is_up(f"127.0.0.1:{h.port}")  # new requests go elsewhere
        await eventually(lambda: h.scheduler.aborts() == ["r1"])


async def test_a_refused_dispatch_only_drops_local_state(harness: Harness) -> None:
    harness.scheduler.refuse = {"r1"}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.consume("r1")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert len(harness.manager.table) == 0
    await harness.settled()
    assert harness.scheduler.events == []


async def test_a_refusal_inside_a_batch_keeps_its_code_and_field(harness: Harness) -> None:
    harness.scheduler.refuse = {"bad"}
    ok = [asyncio.create_task(harness.consume(f"ok{i}")) for i in range(3)]
    bad = asyncio.create_task(harness.consume("bad"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await bad
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert field_of(err.value) == "rid" and err.value.details() == "rid: in flight elsewhere"
    assert harness.scheduler.num_add_calls == 1  # all four went out together
    for i in range(3):
        harness.detokenizer.send(f"ok{i}", "done", final=True)
    assert [len(rows) for rows in await asyncio.gather(*ok)] == [1, 1, 1]
    assert len(harness.manager.table) == 0


async def test_a_burst_goes_out_in_fewer_calls_than_requests(harness: Harness) -> None:
    rids = [f"burst{i}" for i in range(16)]
    tasks = [asyncio.create_task(harness.consume(rid)) for rid in rids]
    for rid in rids:
        await added(harness, rid)
    assert sorted(harness.scheduler.received) == sorted(rids)
    assert harness.scheduler.num_add_calls < len(rids) // 4
    for rid in rids:
        harness.detokenizer.send(rid, "done", final=True)
    await asyncio.gather(*tasks)
    assert len(harness.manager.table) == 0


async def test_when_one_choice_is_refused_the_dispatched_ones_are_aborted(
    harness: Harness,
) -> None:
    harness.scheduler.refuse = {"r-1"}
    with pytest.raises(grpc.aio.AioRpcError):
        await harness.consume("r-0", "r-1")
    assert len(harness.manager.table) == 0
    await harness.settled()
    assert harness.scheduler.aborts() == ["r-0"]


async def test_a_duplicate_in_flight_rid_is_refused_before_dispatch(harness: Harness) -> None:
    first = asyncio.create_task(harness.consume("r1"))
    await added(harness, "r1")
    with pytest.raises(AlreadyExistsError):
        await harness.consume("r1")
    assert harness.scheduler.events == [("add", "r1")] and len(harness.manager.table) == 1
    harness.detokenizer.send("r1", "done", final=True)
    await first
    assert len(harness.manager.table) == 0


async def test_losing_the_detokenizer_ends_requests_and_aborts_them(harness: Harness) -> None:
    task = asyncio.create_task(harness.consume("r1"))
    await added(harness, "r1")
    harness.detokenizer.queue.put_nowait(None)  # the subscription breaks
    with pytest.raises(UnavailableError):  # a lost service: the client may retry
        await task
    await eventually(lambda: harness.scheduler.aborts() == ["r1"])
    assert len(harness.manager.table) == 0


async def test_a_scheduler_abort_row_ends_the_request_without_an_abort_back(
    harness: Harness,
) -> None:
    async def play(request: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        row = detokenizer_pb2.StrRow(rid=request.rid)
        row.finish_reason.kind = common_pb2.FinishReason.KIND_ABORT
        row.finish_reason.message = "evicted"
        harness.detokenizer.queue.put_nowait(detokenizer_pb2.BatchStrOutput(rows=[row]))

    harness.scheduler.on_add = play
    ((index, row),) = await harness.consume("r1")  # a finish, not an error
    assert index == 0 and row.finish_reason.kind == common_pb2.FinishReason.KIND_ABORT
    assert row.finish_reason.message == "evicted"
    await harness.settled()
    assert harness.scheduler.aborts() == []


async def test_losing_the_scheduler_lease_fails_its_requests_at_once(harness: Harness) -> None:
    task = asyncio.create_task(harness.consume("r1"))
    await added(harness, "r1")
    harness.scheduler.lease_ended.set()  # the scheduler aborts this frontend's requests
    with pytest.raises(UnavailableError, match="unavailable"):
        await asyncio.wait_for(task, 2.0)
    assert len(harness.manager.table) == 0
    assert not harness.manager.can_serve  # no lease, no readiness
    harness.scheduler.lease_ended.clear()
    await eventually(lambda: harness.manager.can_serve)  # the router attaches again


async def test_rids_are_unique_and_name_their_frontend(harness: Harness) -> None:
    rids = [harness.manager.new_rid() for _ in range(1000)]
    assert len(set(rids)) == 1000 and all(r.startswith("fe-test-") for r in rids)
