"""AddRequestBatcher against a fake scheduler (a real grpc.aio server on loopback whose
AddRequests is scripted per test): what goes out together, and how every request of a
call learns its own answer, including when the call as a whole fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import status_pb2
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.deadlines import ENGINE_ANSWER_RPC_TIMEOUT_S
from services.frontend.__main__ import parse_args
from services.frontend.dispatch.add_request_batcher import AddRequestBatcher, may_have_reached


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.calls: list[list[str]] = []  # rids of each AddRequests call
        self.answer_only = None  # answer only this many requests (a broken server)
        self.fail_with: grpc.StatusCode | None = None
        self.gate = asyncio.Event()  # calls are answered only while it is set
        self.gate.set()
        self.num_waiting = 0
        self.target = ""  # where it listens

    async def AddRequests(self, request, context):  # noqa: N802
        self.calls.append([r.rid for r in request.reqs])
        self.num_waiting += 1
        await self.gate.wait()
        self.num_waiting -= 1
        if self.fail_with is not None:
            await context.abort(self.fail_with, "scheduler is draining")
        results = [status_pb2.Status() for _ in request.reqs][: self.answer_only]
        return scheduler_pb2.AddReqBatchAck(results=results)


@pytest.fixture
async def setup() -> AsyncIterator[tuple[FakeScheduler, AddRequestBatcher]]:
    fake = FakeScheduler()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fake.target = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(fake.target)
    batcher = AddRequestBatcher(scheduler_pb2_grpc.SchedulerServiceStub(channel))
    yield fake, batcher
    await batcher.close()
    await channel.close()
    await server.stop(0)


def req(rid: str) -> scheduler_pb2.TokenizedGenerateReqInput:
    return scheduler_pb2.TokenizedGenerateReqInput(rid=rid, input_ids=[1, 2, 3])


async def test_one_turn_is_one_call_and_a_lone_request_goes_at_once(setup: tuple) -> None:
    fake, batcher = setup
    await asyncio.gather(*(batcher.submit(req(f"r{i}")) for i in range(5)))
    await batcher.submit(req("alone"))
    assert fake.calls == [[f"r{i}" for i in range(5)], ["alone"]]
    assert (batcher.num_calls, batcher.num_requests) == (2, 6)


async def test_a_failed_call_fails_each_of_its_requests(setup: tuple) -> None:
    fake, batcher = setup
    fake.fail_with = grpc.StatusCode.UNAVAILABLE
    results = await asyncio.gather(
        *(batcher.submit(req(f"r{i}")) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, grpc.aio.AioRpcError) for r in results)
    assert {r.code() for r in results} == {grpc.StatusCode.UNAVAILABLE}
    assert not any(may_have_reached(r) for r in results)  # the scheduler said no: none held


async def test_a_request_left_unanswered_is_an_internal_error(setup: tuple) -> None:
    fake, batcher = setup
    fake.answer_only = 1
    first, second = await asyncio.gather(
        batcher.submit(req("a")), batcher.submit(req("b")), return_exceptions=True
    )
    assert first is None
    assert isinstance(second, grpc.aio.AioRpcError)
    assert second.code() == grpc.StatusCode.INTERNAL


async def until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.001)


async def test_requests_submitted_while_a_call_is_out_go_as_one_call(setup: tuple) -> None:
    fake, batcher = setup
    fake.gate.clear()
    first = batcher.submit(req("first"))
    await until(lambda: fake.num_waiting == 1)
    later = []
    for i in range(4):  # each in a turn of its own, as a gateway's opens arrive
        later.append(batcher.submit(req(f"r{i}")))
        await asyncio.sleep(0)
    assert fake.calls == [["first"]]  # nothing else went out while it was held
    fake.gate.set()
    await asyncio.gather(first, *later)
    assert fake.calls == [["first"], [f"r{i}" for i in range(4)]]
    assert (batcher.num_calls, batcher.num_requests) == (2, 5)


async def test_max_in_flight_bounds_the_calls_out(setup: tuple) -> None:
    fake, _ = setup
    channel = grpc.aio.insecure_channel(fake.target)
    batcher = AddRequestBatcher(scheduler_pb2_grpc.SchedulerServiceStub(channel), max_in_flight=2)
    fake.gate.clear()
    futures = []
    for i in range(4):  # r0 and r1 take the two slots, each once the last call is out
        futures.append(batcher.submit(req(f"r{i}")))
        await until(lambda i=i: fake.num_waiting == min(i + 1, 2))
    await asyncio.sleep(0)  # a turn in which r2 and r3 could go, were a slot free
    assert fake.calls == [["r0"], ["r1"]]
    fake.gate.set()
    await asyncio.gather(*futures)
    assert fake.calls == [["r0"], ["r1"], ["r2", "r3"]]
    await batcher.close()
    await channel.close()


async def test_close_sends_what_waits_for_a_slot(setup: tuple) -> None:
    fake, batcher = setup
    fake.gate.clear()
    first = batcher.submit(req("first"))
    await until(lambda: fake.num_waiting == 1)
    second = batcher.submit(req("second"))
    closing = asyncio.ensure_future(batcher.close())
    await asyncio.sleep(0)  # close() runs up to its wait for the held call
    assert not closing.done()
    fake.gate.set()
    await closing
    assert first.done() and second.done() and second.exception() is None
    assert fake.calls == [["first"], ["second"]]


async def test_a_call_past_its_deadline_fails_its_requests_as_possibly_held(setup: tuple) -> None:
    fake, _ = setup
    channel = grpc.aio.insecure_channel(fake.target)
    batcher = AddRequestBatcher(scheduler_pb2_grpc.SchedulerServiceStub(channel), timeout_s=0.2)
    fake.gate.clear()  # a scheduler that takes the call and never answers
    results = await asyncio.gather(
        *(batcher.submit(req(f"r{i}")) for i in range(3)), return_exceptions=True
    )
    assert [r.code() for r in results] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 3
    assert all(may_have_reached(r) for r in results)  # it may hold them: they need aborts
    fake.gate.set()
    assert await batcher.submit(req("next")) is None  # the slot was freed: later ones go
    assert fake.calls == [["r0", "r1", "r2"], ["next"]]
    await batcher.close()
    await channel.close()


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"max_in_flight": 0}, "max_in_flight"), ({"timeout_s": 0}, "timeout_s")]
)
def test_bad_bounds_are_refused(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        AddRequestBatcher(None, **kwargs)  # type: ignore[arg-type]


def test_the_frontend_flags_set_both_bounds() -> None:
    config = parse_args(
        ["--model", "m", "--add-calls-in-flight", "2", "--add-requests-timeout", "7.5"]
    )
    assert (config.add_calls_in_flight, config.add_requests_timeout) == (2, 7.5)
    defaults = parse_args(["--model", "m"])
    assert (defaults.add_calls_in_flight, defaults.add_requests_timeout) == (
        1,
        ENGINE_ANSWER_RPC_TIMEOUT_S,
    )
    for bad in (["--add-calls-in-flight", "0"], ["--add-requests-timeout", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", *bad])
