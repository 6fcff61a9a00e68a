"""Bytes that do not parse as the request's message type end INVALID_ARGUMENT (grpc alone
answers INTERNAL), on a real grpc.aio server; valid ones still reach the handler."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from tokenline.v1 import frontend_pb2

from services.common.rpc.metrics import RpcMetrics
from services.common.rpc.server import GrpcProcess

pytestmark = pytest.mark.unit

Request = frontend_pb2.TokenizeRequest


async def _count(request: Any, context: Any) -> bytes:
    return str(len(request.prompt)).encode()


async def _stream(request: Any, context: Any) -> AsyncIterator[bytes]:
    yield request.prompt.encode()


@pytest.fixture
async def address() -> AsyncIterator[str]:
    proc = GrpcProcess(
        host="127.0.0.1", port=0, service_names=[], rpc_metrics=RpcMetrics(CollectorRegistry())
    )
    handlers = {
        "U": grpc.unary_unary_rpc_method_handler(_count, request_deserializer=Request.FromString),
        "S": grpc.unary_stream_rpc_method_handler(_stream, request_deserializer=Request.FromString),
    }
    proc.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.D", handlers),))
    await proc.start()
    yield f"127.0.0.1:{proc.port}"
    await proc.server.stop(None)


# Field 2 (`prompt`, a proto3 string) holding invalid UTF-8; a length past the end.
@pytest.mark.parametrize("raw", [b"\x12\x02\xff\xfe", b"\x12\x7fab"])
async def test_undecodable_bytes_are_invalid_argument(address: str, raw: bytes) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/t.D/U")(raw)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid message" in (info.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [m async for m in channel.unary_stream("/t.D/S")(raw)]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_valid_bytes_reach_the_handler(address: str) -> None:
    raw = Request(prompt="hello").SerializeToString()
    async with grpc.aio.insecure_channel(address) as channel:
        assert await channel.unary_unary("/t.D/U")(raw) == b"5"
        assert [m async for m in channel.unary_stream("/t.D/S")(raw)] == [b"hello"]
