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

from services.frontend.add_request_batcher import AddRequestBatcher


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.calls: list[list[str]] = []  # rids of each AddRequests call
        self.answer_only = None  # answer only this many requests (a broken server)
        self.fail_with: grpc.StatusCode | None = None

    async def AddRequests(self, request, context):  # noqa: N802
        self.calls.append([r.rid for r in request.reqs])
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
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
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


async def test_a_request_left_unanswered_is_an_internal_error(setup: tuple) -> None:
    fake, batcher = setup
    fake.answer_only = 1
    first, second = await asyncio.gather(
        batcher.submit(req("a")), batcher.submit(req("b")), return_exceptions=True
    )
    assert first is None
    assert isinstance(second, grpc.aio.AioRpcError)
    assert second.code() == grpc.StatusCode.INTERNAL
