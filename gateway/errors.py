"""The one mapping of failures onto HTTP statuses and OpenAI-shaped error bodies.

Everything a client sees on failure is ``{"error": {"message", "type", "param", "code"}}``
(Anthropic's shape on Anthropic's routes: ``gateway/anthropic_errors.py``) with a status
from ``HTTP_STATUS_FOR_GRPC``; no traceback ever leaves the process.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.anthropic_errors import anthropic_error_body, speaks_anthropic
from gateway.responses import ErrorObject, ErrorResponse
from services.common.errors import field_of, retry_after_of

logger = logging.getLogger(__name__)

HTTP_STATUS_FOR_GRPC: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# gRPC's own text when the channel cannot connect; it names internal addresses.
_CONNECT_FAILURE = "failed to connect to all addresses"


class GatewayError(Exception):
    """A client-visible failure raised by the gateway itself."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # None: the default for 429 and 503

    def body(self, path: str = "") -> dict[str, Any]:
        """The error body for a request to ``path``."""
        return error_body(self.status, self.message, param=self.param, code=self.code, path=path)


def error_body(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    path: str = "",
) -> dict[str, Any]:
    """The OpenAI error object, or Anthropic's for a request to one of its routes (``path``);
    `type` follows the HTTP status."""
    if speaks_anthropic(path):
        return anthropic_error_body(status, message, param)
    error_type = _ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    error = ErrorObject(message=message, type=error_type, param=param, code=code)
    return ErrorResponse(error=error).dump()


def from_rpc_error(exc: grpc.aio.AioRpcError) -> GatewayError:
    """Translate a frontend status; `param` is the field its rich status names, if any."""
    code = exc.code()
    message = exc.details() or code.name.lower()
    if code == grpc.StatusCode.UNAVAILABLE and message.startswith(_CONNECT_FAILURE):
        message = "the frontend service is unreachable"  # not the internal address
    status = HTTP_STATUS_FOR_GRPC.get(code, 500)
    return GatewayError(
        status,
        message,
        param=field_of(exc),
        code=code.name.lower(),
        retry_after_s=retry_after_of(exc),
    )


# pydantic names union members in `loc` ("str", "list[int]", "ContentPartBody");
# request fields are snake_case, so the first segment that is not one ends the path.
_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def param_from_loc(loc: Sequence[str | int]) -> tuple[str | None, bool]:
    """`("body", "messages", 0, "content", "str")` → `("messages[0].content", True)`; a
    query or path parameter is named alone (`("query", "limit")` → `"limit"`).

    The flag says a union member tag cut the path short (no accepted type matched).
    """
    text = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _FIELD_NAME.match(part) and part not in _TYPE_TAGS:
            text += f".{part}" if text else part
        else:
            return text or None, True
    return text or None, False


def _validation_error(exc: RequestValidationError) -> GatewayError:
    first: dict[str, Any] = next(iter(exc.errors()), {})
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "invalid JSON")
        return GatewayError(400, f"malformed JSON body: {detail}", code="invalid_json")
    param, is_union = param_from_loc(first.get("loc", ()))
    message = "matches none of the accepted types" if is_union else str(first.get("msg"))
    if param is None:  # the body itself: absent, not JSON-typed, or not an object
        message = "the request body must be a JSON object (Content-Type: application/json)"
    return GatewayError(
        400, f"{param}: {message}" if param else message, param=param, code="invalid_value"
    )


# Seconds a client should wait before retrying an overloaded (429) or unavailable (503)
# service; the OpenAI SDKs honour Retry-After in their own retries.
RETRY_AFTER_S = 1
_RETRYABLE_STATUSES = frozenset({429, 503})


def json_error(err: GatewayError, path: str = "") -> JSONResponse:
    headers = None
    if err.status in _RETRYABLE_STATUSES:
        # Whole seconds, rounded up (RFC 9110): a client never comes back too early.
        wait_s = RETRY_AFTER_S if err.retry_after_s is None else math.ceil(err.retry_after_s)
        headers = {"Retry-After": str(max(wait_s, 1))}
    return JSONResponse(err.body(path), status_code=err.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every expected failure through `error_body`."""

    async def on_gateway_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, GatewayError)
        return json_error(exc, request.url.path)

    async def on_rpc_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, grpc.aio.AioRpcError)
        err = from_rpc_error(exc)
        if err.status >= 500:
            rid = getattr(request.state, "request_id", "-")
            logger.warning("frontend call failed: %s (rid=%s)", exc.code().name, rid)
        return json_error(err, request.url.path)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return json_error(_validation_error(exc), request.url.path)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return json_error(GatewayError(exc.status_code, str(exc.detail)), request.url.path)

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(grpc.aio.AioRpcError, on_rpc_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
