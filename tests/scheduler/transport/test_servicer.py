"""The scheduler's gRPC shell over a real engine thread: AddRequest, Abort, GetInfo and
the frontends' Attach leases."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from tokenline.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

from services.common.errors import call_error, field_of
from services.scheduler.core.output_row import OutputRow
from services.scheduler.transport.engine_thread import EngineThread
from services.scheduler.transport.servicer import SchedulerServicer
from tests.scheduler.factories import make_scheduler

PROMPT = [0, *range(1000, 1120)]


@pytest.fixture
async def stub(default_model_dir: Path) -> AsyncIterator[tuple]:
    outbox: queue.Queue[Sequence[OutputRow]] = queue.Queue()
    engine = EngineThread(make_scheduler(default_model_dir, max_running_requests=1), outbox.put)
    engine.start()
    servicer = SchedulerServicer("tokenline-tiny")
    servicer.attach(engine, 4096, "float32")  # make_scheduler's dtype
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    rows: list[OutputRow] = []
    drainer = asyncio.create_task(drain(outbox, rows))
    client = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    lease = await attach(client, "fe")
    yield client, rows
    lease.cancel()
    drainer.cancel()
    await channel.close()
    await server.stop(0)
    engine.stop()


def request(
    rid: str, max_new_tokens: int, owner: str = "fe"
) -> scheduler_pb2.TokenizedGenerateReqInput:
    params = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    return scheduler_pb2.TokenizedGenerateReqInput(
        rid=rid, input_ids=PROMPT, sampling_params=params, reply_to=owner
    )


async def attach(client, frontend_id: str):
    """Open a lease as a frontend would; returns the call (cancel it to end the lease)
    once the first beat arrived."""
    call = client.Attach()
    await call.write(scheduler_pb2.AttachRequest(frontend_id=frontend_id))
    await call.read()
    renew = asyncio.ensure_future(_renew(call, frontend_id))
    call.add_done_callback(lambda _: renew.cancel())
    return call


async def _renew(call, frontend_id: str) -> None:
    while True:
        await asyncio.sleep(0.25)
        await call.write(scheduler_pb2.AttachRequest(frontend_id=frontend_id))


async def drain(outbox: queue.Queue[Sequence[OutputRow]], rows: list[OutputRow]) -> None:
    """Stand in for the detokenizer pusher: collect every step's rows."""
    while True:
        with contextlib.suppress(queue.Empty):
            batch = await asyncio.to_thread(outbox.get, timeout=0.2)
            rows.extend(batch)


async def wait_for_finishes(rows: list[OutputRow], rids: set[str]) -> None:
    for _ in range(300):
        if rids <= {r.rid for r in rows if r.finish}:
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"no final rows for {rids}")


async def info_when(client, predicate) -> scheduler_pb2.SchedulerInfo:
    """GetInfo once the engine's published stats satisfy ``predicate`` (they lag a step)."""
    for _ in range(300):
        snapshot = await client.GetInfo(scheduler_pb2.ServerInfoRequest())
        if predicate(snapshot):
            return snapshot
        await asyncio.sleep(0.1)
    pytest.fail(f"scheduler info never matched: {snapshot}")


async def test_duplicate_abort_and_info(stub: tuple) -> None:
    client, rows = stub
    await client.AddRequest(request("long", 10_000))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.AddRequest(request("long", 4))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "rid" in info.value.details()
    await client.AddRequest(request("queued", 4))  # max_running_requests=1: it waits

    snapshot = await info_when(client, lambda s: s.num_waiting == 1)
    assert snapshot.num_running == 1
    assert (snapshot.model, snapshot.dtype) == ("tokenline-tiny", "float32")
    assert snapshot.num_cached_kv_tokens >= len(PROMPT)  # its prompt is in the prefix cache
    assert snapshot.num_free_kv_tokens < snapshot.num_total_kv_tokens

    assert (await client.Abort(scheduler_pb2.AbortReq(rid="long", reason="test"))).found
    assert not (await client.Abort(scheduler_pb2.AbortReq(rid="long"))).found
    assert not (await client.Abort(scheduler_pb2.AbortReq(rid="unknown"))).found
    await wait_for_finishes(rows, {"long", "queued"})
    finishes = {r.rid: r.finish.kind for r in rows if r.finish}
    assert finishes == {"long": "abort", "queued": "length"}
    queued = next(r for r in rows if r.rid == "queued")
    assert queued.num_cached_tokens == len(PROMPT) - 1  # same prompt as "long"

    snapshot = await info_when(client, lambda s: s.num_running == 0)
    assert snapshot.num_waiting == 0
    assert (
        snapshot.num_free_kv_tokens + snapshot.num_cached_kv_tokens == snapshot.num_total_kv_tokens
    )


async def test_a_request_needs_its_frontends_lease(stub: tuple) -> None:
    client, _ = stub
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.AddRequest(request("stray", 4, owner="fe-without-lease"))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "fe-without-lease" in info.value.details()


async def test_a_lease_ending_aborts_that_frontends_requests_only(stub: tuple) -> None:
    client, rows = stub
    other = await attach(client, "fe-2")
    await client.AddRequest(request("mine-running", 10_000, owner="fe-2"))
    await client.AddRequest(request("mine-waiting", 10_000, owner="fe-2"))
    await client.AddRequest(request("theirs", 4))  # from "fe", whose lease stays
    beat = await other.read()
    while beat.num_accepted < 2:
        beat = await other.read()
    assert beat.num_accepted == 2 and beat.info.model == "tokenline-tiny"
    other.cancel()  # fe-2 goes away
    await wait_for_finishes(rows, {"mine-running", "mine-waiting", "theirs"})
    finishes = {r.rid: r.finish for r in rows if r.finish}
    assert finishes["mine-running"].kind == finishes["mine-waiting"].kind == "abort"
    assert "fe-2 went away" in finishes["mine-running"].message
    assert finishes["theirs"].kind == "length"
    snapshot = await info_when(client, lambda s: s.num_running == 0 and s.num_waiting == 0)
    assert snapshot.num_free_kv_tokens + snapshot.num_cached_kv_tokens == (
        snapshot.num_total_kv_tokens
    )


async def test_a_lease_not_renewed_lapses_and_aborts_its_requests(stub: tuple) -> None:
    """A frozen frontend keeps its connection open; only the missing renewals show it."""
    client, rows = stub
    call = client.Attach()
    await call.write(scheduler_pb2.AttachRequest(frontend_id="fe-frozen"))
    await call.read()
    await client.AddRequest(request("frozen-owner", 10_000, owner="fe-frozen"))
    await wait_for_finishes(rows, {"frozen-owner"})  # no renewal was ever sent
    (final,) = [r for r in rows if r.rid == "frozen-owner" and r.finish]
    # The lapsed lease ended it, not its 10,000 tokens: the message names the owner.
    assert final.finish.kind == "abort" and "fe-frozen went away" in final.finish.message
    while (beat := await call.read()) is not grpc.aio.EOF:  # the scheduler ended it
        assert beat.info.model == "tokenline-tiny"


async def test_a_batch_answers_each_request_as_its_own_call_would(stub: tuple) -> None:
    client, rows = stub
    too_long = request("too-long", 4)
    too_long.input_ids.extend([5] * 5000)  # past the context length
    batch = scheduler_pb2.AddReqBatch(
        reqs=[
            request("first", 3),
            request("first", 3),  # a duplicate of the one just accepted
            too_long,
            request("no-lease", 3, owner="fe-without-lease"),
            request("second", 3),
        ]
    )
    ack = await client.AddRequests(batch)
    codes = (
        [grpc.StatusCode.OK.value[0]]
        + [
            code.value[0]
            for code in (
                grpc.StatusCode.ALREADY_EXISTS,
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.UNAVAILABLE,
            )
        ]
        + [grpc.StatusCode.OK.value[0]]
    )
    assert [r.code for r in ack.results] == codes
    assert ack.results[1].message.startswith("rid: ")
    assert call_error(ack.results[1]).code() == grpc.StatusCode.ALREADY_EXISTS
    assert field_of(call_error(ack.results[1])) == "rid"
    assert field_of(call_error(ack.results[2])) == "prompt"
    # The accepted two run to the end; the refused ones never reached the engine.
    await wait_for_finishes(rows, {"first", "second"})
    assert {r.rid for r in rows} == {"first", "second"}


async def test_a_lease_opened_while_the_model_loads_beats_once_the_engine_is_up(
    default_model_dir: Path,
) -> None:
    """A frontend that attaches early is held, not refused, and gets its first beat when
    the engine attaches; a request before then is still refused as the model loads."""
    servicer = SchedulerServicer("tokenline-tiny")
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    engine = EngineThread(make_scheduler(default_model_dir), lambda rows: None)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        call = client.Attach()
        await call.write(scheduler_pb2.AttachRequest(frontend_id="fe-early"))
        first_beat = asyncio.ensure_future(call.read())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.AddRequest(request("early", 1, owner="fe-early"))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "loading the model" in refused.value.details()
        assert not first_beat.done()
        engine.start()
        servicer.attach(engine, 4096, "float32")
        beat = await asyncio.wait_for(first_beat, timeout=30)
        assert isinstance(beat, scheduler_pb2.SchedulerBeat)
        assert servicer.leases.holds("fe-early")
        call.cancel()
    await server.stop(0)
    engine.stop()
