"""What server interceptors do to a method handler: say whether a method is open to
everyone, read a call's metadata, refuse a call, or wrap its behavior, for any of the
four call kinds (grpc keeps the one behavior a handler has in a field named by its kind).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

# Probes and tooling need no credential: health and reflection say nothing private.
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
Behavior = Callable[..., Any]


def is_open_method(method: str) -> bool:
    return method.startswith(_OPEN_PREFIXES)


def metadata_value(details: grpc.HandlerCallDetails, name: str) -> str:
    for key, value in details.invocation_metadata or ():
        if key == name and isinstance(value, str):
            return value
    return ""


def wrap_behavior(
    handler: Any,
    unary: Callable[[Behavior], Behavior],
    streaming: Callable[[Behavior], Behavior],
) -> Any:
    """``handler`` with its behavior ``b`` replaced by ``unary(b)`` (a coroutine function)
    or, for a server stream, ``streaming(b)`` (an async generator function)."""
    for kind in _KINDS:
        old = getattr(handler, kind)
        if old is not None:
            wrap = streaming if handler.response_streaming else unary
            return handler._replace(**{kind: wrap(old)})
    return handler


def refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> Any:
    """``handler`` of the same kind, ending at once with ``code``: the servicer never runs."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - abort raised

    return wrap_behavior(handler, lambda _: refuse, lambda _: refuse_stream)
