"""The detokenizer over gRPC: a synthetic scheduler pushes BatchTokenIDOutput, subscribers
act as frontends. The servicer runs in a real grpc.aio server on a free port; the last
test starts the real ``python -m services.detokenizer`` process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from tokenline.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2

from bench.detokenizer_service import DetokenizerProcess
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.metrics import DetokenizerMetrics
from services.detokenizer.server import DetokenizerServicer
from tests.detokenizer.families import Family
from tests.detokenizer.harness import LENGTH, row

KIND_ABORT = common_pb2.FinishReason.KIND_ABORT


@pytest.fixture
def metrics() -> DetokenizerMetrics:
    return DetokenizerMetrics(CollectorRegistry())


@pytest.fixture
async def stub(
    bytelevel: Family, metrics: DetokenizerMetrics
) -> AsyncIterator[detokenizer_pb2_grpc.DetokenizerServiceStub]:
    server = grpc.aio.server()
    servicer = DetokenizerServicer(
        DetokenizerManager(bytelevel.decoder), on_batch=metrics.observe_batch
    )
    detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
    await server.stop(0)


async def subscribe(stub, frontend_id: str):
    call = stub.Subscribe(detokenizer_pb2.SubscribeRequest(frontend_id=frontend_id))
    await call.initial_metadata()  # subscribed before any row is pushed
    return call


async def batches(*steps: Iterable[scheduler_pb2.TokenIDRow]):
    for i, rows in enumerate(steps):
        yield scheduler_pb2.BatchTokenIDOutput(step=i, rows=list(rows))


async def collect_until_finished(call, rids: set[str]) -> dict[str, str]:
    """Text per rid from one subscription, until each rid in ``rids`` has finished."""
    texts: dict[str, str] = {}
    pending = set(rids)
    while pending:
        batch = await asyncio.wait_for(call.read(), timeout=10)
        for r in batch.rows:
            texts[r.rid] = texts.get(r.rid, "") + r.text
            if r.HasField("finish_reason"):
                pending.discard(r.rid)
    return texts


async def test_each_frontend_gets_only_its_rows(
    stub, bytelevel: Family, metrics: DetokenizerMetrics
) -> None:
    fe1, fe2 = await subscribe(stub, "fe-1"), await subscribe(stub, "fe-2")
    owners = {"a": "fe-1", "b": "fe-2", "c": "fe-1", "d": "fe-2"}
    text = {rid: f"{rid}: 你好，世界 👩\u200d👩\u200d👧 {rid}" for rid in owners}
    ids = {rid: bytelevel.encode(t) for rid, t in text.items()}
    steps = [
        [
            row(rid, ids[rid][i : i + 1], init=i == 0, reply_to=owners[rid],
                finish=LENGTH if i == len(ids[rid]) - 1 else None)
            for rid in owners
            if i < len(ids[rid])
        ]
        for i in range(max(map(len, ids.values())))
    ]  # fmt: skip
    ack = await stub.PushTokenBatches(batches(*steps))
    assert ack.num_batches == len(steps)
    got1 = await collect_until_finished(fe1, {"a", "c"})
    got2 = await collect_until_finished(fe2, {"b", "d"})
    assert got1 == {"a": text["a"], "c": text["c"]}
    assert got2 == {"b": text["b"], "d": text["d"]}
    value = metrics.registry.get_sample_value
    assert value("tokenline_detokenizer_batch_seconds_count") == len(steps)
    assert value("tokenline_detokenizer_rows_total") == sum(map(len, steps))
    info = await stub.GetInfo(detokenizer_pb2.DetokenizerInfoRequest())
    assert (info.num_live_states, info.num_subscribers, info.num_dropped_rows) == (0, 2, 0)
    fe1.cancel()
    fe2.cancel()


async def test_ended_push_stream_aborts_its_live_requests(stub, bytelevel: Family) -> None:
    fe = await subscribe(stub, "fe")
    await stub.PushTokenBatches(batches([row("r", bytelevel.encode("hi"), init=True)]))
    texts, finals = "", []
    while not finals:
        batch = await asyncio.wait_for(fe.read(), timeout=10)
        texts += "".join(r.text for r in batch.rows)
        finals += [r for r in batch.rows if r.HasField("finish_reason")]
    assert texts == "hi"
    assert finals[0].finish_reason.kind == KIND_ABORT
    assert "scheduler stream ended" in finals[0].finish_reason.message
    info = await stub.GetInfo(detokenizer_pb2.DetokenizerInfoRequest())
    assert info.num_live_states == 0
    fe.cancel()


async def test_subscribe_without_frontend_id_is_invalid_argument(stub) -> None:
    call = stub.Subscribe(detokenizer_pb2.SubscribeRequest())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "frontend_id" in err.value.details()


async def test_second_subscription_with_the_same_id_replaces_the_first(stub) -> None:
    first = await subscribe(stub, "fe")
    second = await subscribe(stub, "fe")
    assert await asyncio.wait_for(first.read(), timeout=10) is grpc.aio.EOF
    info = await stub.GetInfo(detokenizer_pb2.DetokenizerInfoRequest())
    assert info.num_subscribers == 1
    second.cancel()


@pytest.mark.live  # a fresh interpreter: the live tier holds subprocesses
async def test_real_process_refuses_past_max_decode_states(
    default_model_dir: Path, tmp_path: Path, bytelevel: Family
) -> None:
    args = ["--max-decode-states", "1"]
    with DetokenizerProcess(default_model_dir, args, log=tmp_path / "detok.log") as proc:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
            fe = await subscribe(stub, "fe")
            ids = bytelevel.encode("hello")
            await stub.PushTokenBatches(
                batches([row("a", ids, init=True), row("b", ids, init=True)])
            )
            batch = await asyncio.wait_for(fe.read(), timeout=10)
            rows = {r.rid: r for r in batch.rows}
            assert rows["b"].finish_reason.kind == KIND_ABORT
            assert "--max-decode-states" in rows["b"].finish_reason.message
            assert rows["a"].text == "hello" and not rows["a"].HasField("finish_reason")
            info = await stub.GetInfo(detokenizer_pb2.DetokenizerInfoRequest())
            assert info.num_refused_requests == 1
            fe.cancel()
