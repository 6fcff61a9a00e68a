"""RpcMetricsInterceptor against a real grpc.aio server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from services.common.rpc.metrics import RpcMetrics, RpcMetricsInterceptor
from services.common.rpc.server import GrpcProcess, wait_until
from tests.waiting import eventually

SERVICE = "test.Echo"


async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def reject(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")


async def crash(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise RuntimeError("boom")


async def three(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for i in range(3):
        yield request + bytes([i])


async def endless(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    while True:
        yield request
        await asyncio.sleep(0.01)


async def flood(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    while True:  # never awaits itself: cancellation lands while grpc is sending
        yield request


async def bidi_echo(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request


HANDLERS = {
    "Echo": grpc.unary_unary_rpc_method_handler(echo),
    "Reject": grpc.unary_unary_rpc_method_handler(reject),
    "Crash": grpc.unary_unary_rpc_method_handler(crash),
    "Three": grpc.unary_stream_rpc_method_handler(three),
    "Endless": grpc.unary_stream_rpc_method_handler(endless),
    "Flood": grpc.unary_stream_rpc_method_handler(flood),
    "BidiEcho": grpc.stream_stream_rpc_method_handler(bidi_echo),
}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def channel(registry: CollectorRegistry) -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server(interceptors=[RpcMetricsInterceptor(RpcMetrics(registry))])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
        yield chan
    await server.stop(None)


def sample(
    registry: CollectorRegistry, name: str, method: str, rpc_type: str, **extra: str
) -> float | None:
    labels = {"grpc_service": SERVICE, "grpc_method": method, "grpc_type": rpc_type, **extra}
    return registry.get_sample_value(f"tokenline_grpc_server_{name}", labels)


async def test_unary_ok_counts_and_latency(
    channel: grpc.aio.Channel, registry: CollectorRegistry
) -> None:
    call = channel.unary_unary(f"/{SERVICE}/Echo")
    assert await call(b"a") == b"a"
    assert await call(b"b") == b"b"
    assert sample(registry, "started_total", "Echo", "unary") == 2
    assert sample(registry, "handled_total", "Echo", "unary", grpc_code="OK") == 2
    assert sample(registry, "handling_seconds_count", "Echo", "unary") == 2
    assert sample(registry, "handling_seconds_sum", "Echo", "unary") > 0
    assert sample(registry, "msg_received_total", "Echo", "unary") == 2
    assert sample(registry, "msg_sent_total", "Echo", "unary") == 2


@pytest.mark.parametrize(
    ("method", "code"),
    [("Reject", "INVALID_ARGUMENT"), ("Crash", "UNKNOWN")],
    ids=["abort-keeps-its-code", "exception-is-unknown"],
)
async def test_failed_calls_record_their_code(
    channel: grpc.aio.Channel, registry: CollectorRegistry, method: str, code: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary(f"/{SERVICE}/{method}")(b"x")
    assert err.value.code().name == code
    # An abort sends its status before the aborting handler unwinds, so the client may
    # hear it before the interceptor's bookkeeping runs: wait for that, then check all.
    await eventually(
        lambda: sample(registry, "handled_total", method, "unary", grpc_code=code) == 1,
        what=f"{method} counted as {code}",
    )
    assert sample(registry, "handled_total", method, "unary", grpc_code="OK") is None
    assert sample(registry, "handling_seconds_count", method, "unary") == 1
    assert sample(registry, "msg_sent_total", method, "unary") == 0


async def test_server_stream_counts_sent_messages(
    channel: grpc.aio.Channel, registry: CollectorRegistry
) -> None:
    got = [m async for m in channel.unary_stream(f"/{SERVICE}/Three")(b"s")]
    assert got == [b"s\x00", b"s\x01", b"s\x02"]
    assert sample(registry, "msg_sent_total", "Three", "server_stream") == 3
    assert sample(registry, "msg_received_total", "Three", "server_stream") == 1
    assert sample(registry, "handled_total", "Three", "server_stream", grpc_code="OK") == 1
    assert sample(registry, "handling_seconds_count", "Three", "server_stream") == 1


async def test_bidi_stream_counts_both_directions(
    channel: grpc.aio.Channel, registry: CollectorRegistry
) -> None:
    async def requests() -> AsyncIterator[bytes]:
        for i in range(4):
            yield bytes([i])

    got = [m async for m in channel.stream_stream(f"/{SERVICE}/BidiEcho")(requests())]
    assert got == [bytes([i]) for i in range(4)]
    assert sample(registry, "msg_received_total", "BidiEcho", "bidi_stream") == 4
    assert sample(registry, "msg_sent_total", "BidiEcho", "bidi_stream") == 4
    assert sample(registry, "handled_total", "BidiEcho", "bidi_stream", grpc_code="OK") == 1


@pytest.mark.parametrize("method", ["Endless", "Flood"])
async def test_client_cancel_mid_stream_is_cancelled(
    channel: grpc.aio.Channel, registry: CollectorRegistry, method: str
) -> None:
    """Endless is cancelled inside its own await; Flood while parked at a yield."""
    call = channel.unary_stream(f"/{SERVICE}/{method}")(b"e")
    for _ in range(3):
        assert await call.read() == b"e"
    call.cancel()

    def cancelled() -> float | None:
        return sample(registry, "handled_total", method, "server_stream", grpc_code="CANCELLED")

    assert await wait_until(lambda: cancelled() == 1, timeout=5)
    assert sample(registry, "started_total", method, "server_stream") == 1
    assert sample(registry, "handled_total", method, "server_stream", grpc_code="UNKNOWN") is None
    assert sample(registry, "msg_sent_total", method, "server_stream") >= 3


async def test_grpc_process_counts_health_check(registry: CollectorRegistry) -> None:
    proc = GrpcProcess(
        host="127.0.0.1", port=0, service_names=["test.Svc"], rpc_metrics=RpcMetrics(registry)
    )
    await proc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proc.port}") as chan:
            reply = await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await proc.server.stop(None)
    labels = {"grpc_service": "grpc.health.v1.Health", "grpc_method": "Check"}
    labels |= {"grpc_type": "unary"}
    assert registry.get_sample_value("tokenline_grpc_server_started_total", labels) == 1
    handled = registry.get_sample_value(
        "tokenline_grpc_server_handled_total", {**labels, "grpc_code": "OK"}
    )
    assert handled == 1
