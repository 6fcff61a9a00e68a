"""A draining GrpcProcess refuses new work UNAVAILABLE itself, still answers other calls,
and stops grpc only once the work calls it took have finished: on a real grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from tokenline.v1 import frontend_pb2

from services.common.rpc.drain import work_methods
from services.common.rpc.metrics import RpcMetrics
from services.common.rpc.server import GrpcProcess

pytestmark = pytest.mark.unit


class HeldWork:
    """Handlers whose work calls stay open until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.unary_started = asyncio.Event()

    async def work(self, request: Any, context: Any) -> bytes:
        self.unary_started.set()
        await self.release.wait()
        return b"done"

    async def stream(self, request: Any, context: Any) -> AsyncIterator[bytes]:
        yield b"first"
        await self.release.wait()
        yield b"last"

    async def info(self, request: Any, context: Any) -> bytes:
        return b"info"


def serving_process(held: HeldWork) -> GrpcProcess:
    proc = GrpcProcess(
        host="127.0.0.1",
        port=0,
        service_names=[],
        rpc_metrics=RpcMetrics(CollectorRegistry()),
        work_methods=["/t.W/Work", "/t.W/Stream"],
    )
    handlers = {
        "Work": grpc.unary_unary_rpc_method_handler(held.work),
        "Stream": grpc.unary_stream_rpc_method_handler(held.stream),
        "Info": grpc.unary_unary_rpc_method_handler(held.info),
    }
    proc.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.W", handlers),))
    return proc


async def test_a_draining_process_refuses_new_work_and_finishes_the_work_it_took() -> None:
    held = HeldWork()
    proc = serving_process(held)
    await proc.start()
    drain_began = asyncio.Event()

    async def on_drain() -> None:
        drain_began.set()

    serving = asyncio.create_task(proc.serve_until_signal(600, on_drain=on_drain))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proc.port}") as channel:
            unary = asyncio.ensure_future(channel.unary_unary("/t.W/Work")(b""))
            stream = channel.unary_stream("/t.W/Stream")(b"")
            assert await stream.read() == b"first"
            await held.unary_started.wait()
            assert proc.drain_gate.in_flight == 2

            proc.request_stop()
            await drain_began.wait()
            # The bound only turns a call the gate let through (it would hang on `release`)
            # into a failure here.
            for method in ("/t.W/Work", "/t.W/Stream"):
                call = (
                    channel.unary_unary(method)(b"", timeout=30)
                    if method.endswith("Work")
                    else channel.unary_stream(method)(b"", timeout=30).read()
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in (refused.value.details() or "")
            assert await channel.unary_unary("/t.W/Info")(b"") == b"info"
            # The server is still up for the work it took: the stop waits on it.
            assert not serving.done()
            assert proc.drain_gate.in_flight == 2

            held.release.set()
            assert await unary == b"done"
            assert await stream.read() == b"last"
            assert await stream.read() is grpc.aio.EOF
            assert await stream.code() == grpc.StatusCode.OK
        await serving
    finally:  # a failed assertion must not leave the server up
        held.release.set()
        await proc.server.stop(None)
    assert proc.drain_gate.in_flight == 0


def test_a_work_method_the_service_lacks_fails_at_start() -> None:
    service = frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"]
    assert work_methods(service, ["Generate"]) == ["/tokenline.v1.FrontendService/Generate"]
    with pytest.raises(KeyError):
        work_methods(service, ["Genrate"])
