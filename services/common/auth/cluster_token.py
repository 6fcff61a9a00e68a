"""What gRPC authentication shares on every service: which methods stay open, how a
handler is refused or run for a caller, and the cluster token.

The cluster token is a secret every service of one deployment holds. Without TLS it is
what keeps strangers off the internal RPCs (the scheduler's and the detokenizer's): a
server given one refuses any call that does not present it as
``authorization: Bearer <token>``; a channel given one presents it on every call. A
frontend also trusts a caller holding it to speak for others (the gateway).
"""

from __future__ import annotations

import argparse
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.auth.api_keys import ApiKey, bearer_token
from services.common.auth.caller import set_caller
from services.common.envs import env_default

# Whom a cluster peer (the gateway) speaks for on a call: a key's name, never its secret.
FORWARDED_CALLER = "x-tokenline-caller"
# Probes and tooling need no credential: health and reflection say nothing private.
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


def is_open_method(method: str) -> bool:
    return method.startswith(_OPEN_PREFIXES)


def metadata_value(details: grpc.HandlerCallDetails, name: str) -> str:
    for key, value in details.invocation_metadata or ():
        if key == name and isinstance(value, str):
            return value
    return ""


def refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> Any:
    """``handler`` of the same kind, ending at once with ``code``: the servicer never runs."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - abort raised

    return _replace_behavior(handler, refuse, refuse_stream)


def as_caller(handler: grpc.RpcMethodHandler, key: ApiKey | None) -> Any:
    """``handler`` running with ``key`` as the current caller (services/common/auth/caller.py)."""

    def unary(behavior: Any) -> Any:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            set_caller(key)
            return await behavior(request, context)

        return run

    def streaming(behavior: Any) -> Any:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            set_caller(key)
            async for item in behavior(request, context):
                yield item

        return run

    return _replace_behavior(handler, unary, streaming, wrap=True)


def _replace_behavior(handler: Any, unary: Any, streaming: Any, *, wrap: bool = False) -> Any:
    """The handler with its one behavior replaced (``wrap``: by ``unary(old)``)."""
    for kind, make in (
        ("unary_unary", unary),
        ("stream_unary", unary),
        ("unary_stream", streaming),
        ("stream_stream", streaming),
    ):
        old = getattr(handler, kind)
        if old is not None:
            return handler._replace(**{kind: make(old) if wrap else make})
    return handler


@dataclass(frozen=True, slots=True)
class ClusterToken:
    """The deployment's shared secret ("": none, internal RPCs stay open, as on loopback).
    Left out of repr, so no log line can show it."""

    value: str = field(default="", repr=False)

    @property
    def is_enabled(self) -> bool:
        return bool(self.value)

    def matches(self, authorization: str) -> bool:
        given = bearer_token(authorization).encode()
        return self.is_enabled and hmac.compare_digest(given, self.value.encode())

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What a call presents (nothing without a token)."""
        if not self.is_enabled:
            return ()
        return (("authorization", f"Bearer {self.value}"),)

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """Channel interceptors adding the token to every call (none without one)."""
        return [kind(self) for kind in _TOKEN_INTERCEPTORS] if self.is_enabled else []

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Server interceptors refusing calls without the token (none without one)."""
        return [ClusterTokenInterceptor(self)] if self.is_enabled else []


class ClusterTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any internal RPC that lacks the cluster token."""

    def __init__(self, token: ClusterToken) -> None:
        self.token = token

    async def intercept_service(
        self, continuation: _Continuation, details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None or is_open_method(details.method):
            return handler
        if self.token.matches(metadata_value(details, "authorization")):
            return handler
        return refusal(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")


class _AddsToken:
    """Adds the token to a call's metadata. grpc.aio files each interceptor under the
    first call kind it implements, so each kind gets its own subclass below."""

    def __init__(self, token: ClusterToken) -> None:
        self._extra = token.metadata()

    def _details(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._extra)
        return details._replace(metadata=metadata)


class _TokenOnUnaryUnary(_AddsToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _TokenOnUnaryStream(_AddsToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _TokenOnStreamUnary(_AddsToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _TokenOnStreamStream(_AddsToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


_TOKEN_INTERCEPTORS = (
    _TokenOnUnaryUnary,
    _TokenOnUnaryStream,
    _TokenOnStreamUnary,
    _TokenOnStreamStream,
)


def add_cluster_token_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster-token-file",
        default=env_default("TOKENLINE_CLUSTER_TOKEN_FILE", None),
        metavar="FILE",
        help="a secret every service of the deployment shares; internal RPCs without it "
        "are refused (TOKENLINE_CLUSTER_TOKEN gives the value itself)",
    )


def pop_cluster_token(args: argparse.Namespace) -> ClusterToken:
    """The token from ``--cluster-token-file`` or ``TOKENLINE_CLUSTER_TOKEN``; removes
    the flag from ``args``. An unreadable or empty file exits naming it."""
    path = args.cluster_token_file
    del args.cluster_token_file
    if path is None:
        return ClusterToken(env_default("TOKENLINE_CLUSTER_TOKEN", ""))
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"cannot read --cluster-token-file {path}: {exc.strerror}") from None
    if not token:
        raise SystemExit(f"--cluster-token-file {path} is empty")
    return ClusterToken(token)
