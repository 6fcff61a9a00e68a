"""ASGI middleware for what every request shares: id, metrics, auth, body size.

Pure ASGI (not BaseHTTPMiddleware) so streaming bodies and disconnect messages
pass through untouched.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import error_body
from gateway.metrics import GatewayMetrics
from services.common.auth.api_keys import KeyRing
from services.common.auth.caller import set_caller

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
# A client's id becomes the rid prefix in every service's logs; keep it printable and short.
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _error(status: int, message: str, code: str, scope: Scope) -> JSONResponse:
    """An error body in the shape the request's route speaks (OpenAI's or Anthropic's)."""
    body = error_body(status, message, code=code, path=scope.get("path", ""))
    return JSONResponse(body, status_code=status)


def request_id_for(headers: Headers) -> str:
    """The client's `X-Request-Id` when usable, else a fresh one."""
    given = headers.get(REQUEST_ID_HEADER, "")
    return given if _VALID_REQUEST_ID.match(given) else uuid.uuid4().hex


class RequestContextMiddleware:
    """Outermost: assigns the request id, echoes it, records metrics, and is the
    last catch so an unexpected exception is a 500 OpenAI body, never a traceback."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_for(Headers(scope=scope))
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        start = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error (rid=%s)", request_id)
            if not started:
                response = _error(500, "internal server error", "internal_error", scope)
                await response(scope, receive, send_with_id)
        finally:
            self.metrics.in_flight.dec()
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe(route, scope["method"], status, time.perf_counter() - start)


# Open without a key: probes, scrapes and the API description. Every other route
# (generation, tokenize, the operator's flush and abort) needs it.
OPEN_PATHS = frozenset(
    {"/health", "/health_generate", "/metrics", "/ping", "/version", "/openapi.json", "/docs"}
)


def is_protected_path(path: str) -> bool:
    return path not in OPEN_PATHS and not path.startswith("/docs/")


def presented_key(headers: Headers) -> str:
    """The key a client presented: ``Authorization: Bearer <key>`` (OpenAI's SDKs) or else
    ``x-api-key: <key>`` (Anthropic's); empty when neither. The one place that reads them."""
    authorization = headers.get("authorization", "")
    if authorization.startswith("Bearer "):
        return authorization.removeprefix("Bearer ")
    return headers.get("x-api-key", "")


class ApiKeyMiddleware:
    """The API key on the API paths (``presented_key``); /health and /metrics stay open.
    The key found is the request's caller (services/common/auth/caller.py), whom the
    frontend is told about; roles and limits are the frontend's to apply."""

    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_protected_path(scope["path"]):
            key = self.keys.authenticate(presented_key(Headers(scope=scope)))
            if key is None:
                response = _error(401, "invalid or missing API key", "invalid_api_key", scope)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
            set_caller(key)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`, declared or streamed; the body is read once
    here and replayed, after which `receive` is the server's own (disconnects pass)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body exceeds {self.max_bytes} bytes"
        await _error(413, message, "request_too_large", scope)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
