"""The cluster token on a real grpc.aio server: every call kind needs it, health and
reflection stay open, and a channel given the token presents it on every kind of call
(grpc.aio files one interceptor object under one call kind only)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from services.common.auth.cluster_token import ClusterToken
from services.common.rpc.metrics import RpcMetrics
from services.common.rpc.server import GrpcProcess
from services.common.tls import open_channel

pytestmark = pytest.mark.unit

TOKEN = ClusterToken("cluster-secret")


async def _unary(request: bytes, context: Any) -> bytes:
    return request


async def _server_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield request


async def _client_stream(requests: AsyncIterator[bytes], context: Any) -> bytes:
    return b"".join([r async for r in requests])


async def _bidi(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for r in requests:
        yield r


HANDLERS = {
    "U": grpc.unary_unary_rpc_method_handler(_unary),
    "S": grpc.unary_stream_rpc_method_handler(_server_stream),
    "C": grpc.stream_unary_rpc_method_handler(_client_stream),
    "B": grpc.stream_stream_rpc_method_handler(_bidi),
}


@pytest.fixture
async def server() -> AsyncIterator[GrpcProcess]:
    proc = GrpcProcess(
        host="127.0.0.1",
        port=0,
        service_names=["t.S"],
        rpc_metrics=RpcMetrics(CollectorRegistry()),
        interceptors=TOKEN.server_interceptors(),
    )
    proc.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", HANDLERS),))
    await proc.start()
    yield proc
    await proc.server.stop(None)


async def _call(channel: grpc.aio.Channel, kind: str) -> list[bytes]:
    """One call of ``kind`` (U, S, C or B); what it answered."""

    async def one() -> AsyncIterator[bytes]:
        yield b"x"

    if kind == "U":
        return [await channel.unary_unary("/t.S/U")(b"x")]
    if kind == "S":
        return [m async for m in channel.unary_stream("/t.S/S")(b"x")]
    if kind == "C":
        return [await channel.stream_unary("/t.S/C")(one())]
    return [m async for m in channel.stream_stream("/t.S/B")(one())]


async def test_a_channel_with_the_token_reaches_every_call_kind(server: GrpcProcess) -> None:
    addr = f"127.0.0.1:{server.port}"
    async with open_channel(addr, None, interceptors=TOKEN.client_interceptors()) as channel:
        assert [await _call(channel, kind) for kind in HANDLERS] == [[b"x"]] * 4


@pytest.mark.parametrize("token", [ClusterToken(), ClusterToken("cluster-secreT")])
async def test_without_the_token_every_call_kind_is_unauthenticated(
    server: GrpcProcess, token: ClusterToken
) -> None:
    addr = f"127.0.0.1:{server.port}"
    async with open_channel(addr, None, interceptors=token.client_interceptors()) as channel:
        for kind in HANDLERS:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _call(channel, kind)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "cluster-secret" not in (info.value.details() or "")
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_token_is_never_in_a_repr() -> None:
    assert "cluster-secret" not in repr(TOKEN)
    assert not ClusterToken().is_enabled and ClusterToken().client_interceptors() == []
