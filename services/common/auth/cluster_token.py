"""The cluster token: a secret every service of one deployment holds. Without TLS it is
what keeps strangers off the internal RPCs (the scheduler's and the detokenizer's): a
server given one refuses any call that does not present it as
``authorization: Bearer <token>``; a channel given one presents it on every call. A
frontend also trusts a caller holding it to speak for others (the gateway).
"""

from __future__ import annotations

import argparse
import hmac
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.auth.api_keys import bearer_token
from services.common.envs import env_default
from services.common.rpc.handlers import is_open_method, metadata_value, refusal

# Whom a cluster peer (the gateway) speaks for on a call: a key's name, never its secret.
FORWARDED_CALLER = "x-tokenline-caller"


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

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
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
