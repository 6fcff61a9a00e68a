"""The gateway's side of the frontend channel: stubs, deadlines, and disconnect races.

A gRPC call started for an HTTP request must not outlive that request's client:
`until_disconnected` cancels the call when the client goes away, so the frontend
aborts the request upstream instead of decoding for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.requests import Request
from tokenline.v1 import frontend_pb2_grpc

from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.multiplex import FrontendMux
from services.common.auth.caller import current_caller
from services.common.auth.cluster_token import FORWARDED_CALLER
from services.common.rpc.server import READINESS_SERVICE
from services.common.tls import open_channel

T = TypeVar("T")

HEALTH_TIMEOUT_S = 2.0
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def create_channel(config: GatewayConfig) -> grpc.aio.Channel:
    """The default channel factory: one long-lived channel to the frontend (TLS per config)."""
    return open_channel(
        config.frontend_addr,
        config.tls,
        options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        ],
        interceptors=config.cluster_token.client_interceptors(),
    )


class StreamCall(Protocol):
    """What the SSE relay reads: a server-streaming call, or one multiplexed stream."""

    def read(self) -> Awaitable[Any]: ...

    def cancel(self) -> bool: ...


class FrontendClient:
    """Stubs over one channel, plus the per-request call options every RPC uses.

    With `mux`, streamed chat and completions go over its one Multiplex call; without,
    each is its own server-streaming RPC (`--no-multiplex`).

    Each call carries the HTTP caller (services/common/auth/caller.py) to the frontend. With
    `forwards_caller` (the channel presents the cluster token) that is the key's name,
    per call or per multiplexed stream. Without, it is the caller's own key, which
    only a call of its own can carry: every user's streams cannot share one Multiplex
    call then, so streams go as their own RPCs whenever there is a caller."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        timeout_s: float | None,
        *,
        multiplex: bool = False,
        forwards_caller: bool = False,
    ) -> None:
        self.channel = channel
        self.stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._timeout_s = timeout_s
        self.forwards_caller = forwards_caller
        self.mux = FrontendMux(self.stub, timeout_s) if multiplex else None

    def options(self, request_id: str) -> dict[str, Any]:
        """Deadline, request id and caller for one call (`stub.X(req, **client.options(rid))`)."""
        metadata = (("x-request-id", request_id), *self._caller_metadata())
        return {"timeout": self._timeout_s, "metadata": metadata}

    def _caller_metadata(self) -> tuple[tuple[str, str], ...]:
        key = current_caller()
        if key is None:
            return ()
        if self.forwards_caller:
            return ((FORWARDED_CALLER, key.name),)
        return (("authorization", f"Bearer {key.secret.decode()}"),)

    def stream_starter(self, kind: str, request: Any, request_id: str) -> Callable[[], StreamCall]:
        """How to start streaming `request` ("chat" or "completion"): a multiplexed
        stream, or the matching `*Stream` RPC."""
        key = current_caller()
        if self.mux is not None and (key is None or self.forwards_caller):
            caller = key.name if key is not None else ""
            return partial(self.mux.open, kind, request, caller)
        rpc = self.stub.ChatCompletionStream if kind == "chat" else self.stub.CompletionStream
        return partial(rpc, request, **self.options(request_id))

    async def is_ready(self) -> bool:
        """True when the frontend's readiness health check answers SERVING."""
        request = health_pb2.HealthCheckRequest(service=READINESS_SERVICE)
        try:
            reply = await self._health.Check(request, timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(
    request: Request, step: Awaitable[T], call: grpc.aio.Call | StreamCall
) -> T:
    """Await one step of `call`; if the HTTP client leaves first, cancel the call (499)."""
    result = asyncio.ensure_future(step)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((result, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        call.cancel()
        result.cancel()
        raise
    finally:
        watcher.cancel()
    if not result.done():
        call.cancel()
        result.cancel()
        raise GatewayError(499, "client closed the request", code="client_closed_request")
    return result.result()
