"""Errors carry their field in gRPC's rich status, over real grpc.aio servers, and keep
it when a service passes an upstream failure on (scheduler -> frontend -> gateway)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.errors import (
    InvalidArgumentError,
    UnavailableError,
    field_of,
    grpc_errors,
)


class Failing(scheduler_pb2_grpc.SchedulerServiceServicer):
    """GetInfo fails with ``error``; or, given ``upstream``, calls it and fails likewise."""

    def __init__(self, error: Exception | None, upstream: str = "") -> None:
        self.error = error
        self.upstream = upstream

    @grpc_errors
    async def GetInfo(self, request, context):  # noqa: N802
        if self.upstream:
            async with grpc.aio.insecure_channel(self.upstream) as channel:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                return await stub.GetInfo(scheduler_pb2.ServerInfoRequest())
        raise self.error


async def serve(servicer: Failing) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server, addr


@pytest.fixture
async def servers() -> AsyncIterator[list[grpc.aio.Server]]:
    started: list[grpc.aio.Server] = []
    yield started
    for server in started:
        await server.stop(None)


async def call(addr: str) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(addr) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scheduler_pb2_grpc.SchedulerServiceStub(channel).GetInfo(
                scheduler_pb2.ServerInfoRequest()
            )
    return err.value


async def test_the_field_is_in_a_bad_request_detail_any_client_can_read(
    servers: list[grpc.aio.Server],
) -> None:
    server, addr = await serve(Failing(InvalidArgumentError("must be >= 0", field="top_k")))
    servers.append(server)
    err = await call(addr)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "top_k: must be >= 0"
    assert field_of(err) == "top_k"
    # What a Go or Node client does: decode google.rpc.Status from the trailer.
    (raw,) = [v for k, v in err.trailing_metadata() if k == "grpc-status-details-bin"]
    (detail,) = status_pb2.Status.FromString(raw).details
    bad = error_details_pb2.BadRequest()
    assert detail.Unpack(bad)
    assert [(v.field, v.description) for v in bad.field_violations] == [("top_k", "must be >= 0")]


async def test_an_error_without_a_field_has_no_detail(servers: list[grpc.aio.Server]) -> None:
    server, addr = await serve(Failing(UnavailableError("engine failed")))
    servers.append(server)
    err = await call(addr)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and field_of(err) is None


async def test_a_service_passing_an_upstream_failure_on_keeps_its_field(
    servers: list[grpc.aio.Server],
) -> None:
    upstream, upstream_addr = await serve(Failing(InvalidArgumentError("too long", field="prompt")))
    middle, middle_addr = await serve(Failing(None, upstream=upstream_addr))
    servers += [upstream, middle]
    err = await call(middle_addr)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details(), field_of(err)) == ("prompt: too long", "prompt")


def test_a_message_quoting_a_huge_value_stays_within_a_trailer() -> None:
    """Clients cap trailers at 8 KiB: an echoed 300k-character value would turn the
    error into RESOURCE_EXHAUSTED on the client's side."""
    error = InvalidArgumentError(f"the model `{'x' * 300_000}` does not exist", field="model")
    status = error.rich_status()
    assert len(status.SerializeToString()) < 4096
    assert status.message.startswith("model: the model `xxx")
    assert status.message.endswith("more characters)")
