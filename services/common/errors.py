"""Domain errors and their one mapping onto gRPC status codes.

Domain code raises these; servicers wrap handlers with ``grpc_errors`` so no
handler converts exceptions itself and no traceback ever reaches a client.

The field an error is about travels in gRPC's rich status (``google.rpc.Status``
with a ``google.rpc.BadRequest`` detail, in the ``grpc-status-details-bin``
trailer), so a client in any language reads it without parsing the message;
``field_of`` is the one reader. The message still starts with the field, for people.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

logger = logging.getLogger(__name__)


# The abort message the detokenizer gives requests whose scheduler stream ended.
SCHEDULER_STREAM_ENDED = "scheduler stream ended"


# A status travels in trailers, which clients cap (8 KiB by default): a message that
# quotes a huge client value must not outgrow them and turn into RESOURCE_EXHAUSTED.
MAX_MESSAGE_CHARS = 1024


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text``, cut to ``limit`` characters with a note of how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class TokenlineError(Exception):
    """Base class: a client-visible error with a gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, field: str | None = None) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message
        self.field = bounded(field, 256) if field else field

    def details(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def rich_status(self) -> status_pb2.Status:
        """This error as a ``google.rpc.Status``: code, details and, with a field, a
        BadRequest (what a per-item result of a batch call carries)."""
        rich = status_pb2.Status(code=self.code.value[0], message=self.details())
        if self.field:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=self.field, description=self.message
            )
            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
            rich.details.append(detail)
        return rich

    def status(self) -> grpc.Status:
        """This error as a call's status, the rich status in its trailer."""
        return rpc_status.to_status(self.rich_status())


def call_error(rich: status_pb2.Status) -> grpc.aio.AioRpcError:
    """A failed per-item result of a batch call as the error its own call would have
    raised: same code and details, the rich status (field included) in the trailer, so
    ``field_of`` and every caller that handles a failed call handle it unchanged."""
    status = rpc_status.to_status(rich)
    trailer = grpc.aio.Metadata(*status.trailing_metadata)
    return grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), trailer, status.details)


def _rich_status(exc: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    """A failed call's ``google.rpc.Status`` from its trailer, where the callee sent one."""
    for key, value in exc.trailing_metadata() or ():
        if key == rpc_status.GRPC_DETAILS_METADATA_KEY:
            return status_pb2.Status.FromString(value)
    return None


M = TypeVar("M", bound=Message)


def _detail(exc: grpc.aio.AioRpcError, kind: type[M]) -> M | None:
    """The first detail of type ``kind`` in a failed call's rich status, if any."""
    rich = _rich_status(exc)
    for detail in rich.details if rich is not None else ():
        if detail.Is(kind.DESCRIPTOR):
            out = kind()
            detail.Unpack(out)
            return out
    return None


def retry_after_of(exc: grpc.aio.AioRpcError) -> float | None:
    """Seconds a failed call's ``google.rpc.RetryInfo`` asks the caller to wait, if any."""
    info = _detail(exc, error_details_pb2.RetryInfo)
    return info.retry_delay.ToNanoseconds() / 1e9 if info is not None else None


def field_of(exc: grpc.aio.AioRpcError) -> str | None:
    """The field a failed call's rich status names (its first BadRequest violation)."""
    bad = _detail(exc, error_details_pb2.BadRequest)
    return bad.field_violations[0].field if bad is not None and bad.field_violations else None


class InvalidArgumentError(TokenlineError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExistsError(TokenlineError):
    code = grpc.StatusCode.ALREADY_EXISTS


class NotFoundError(TokenlineError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhaustedError(TokenlineError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RateLimitedError(ResourceExhaustedError):
    """Over a per-key limit; the status carries a ``google.rpc.RetryInfo`` saying when
    to come back (the gateway's ``Retry-After``)."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def rich_status(self) -> status_pb2.Status:
        rich = super().rich_status()
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(self.retry_after_s * 1e9))
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        rich.details.append(detail)
        return rich


class UnauthenticatedError(TokenlineError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(TokenlineError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnavailableError(TokenlineError):
    code = grpc.StatusCode.UNAVAILABLE


def status_of(exc: BaseException) -> status_pb2.Status:
    """The one mapping of a handler's failure onto a ``google.rpc.Status``: a domain
    error's own code and field, an upstream call's status passed on unchanged, and for
    anything else INTERNAL naming only the exception's type (the traceback is logged)."""
    if isinstance(exc, TokenlineError):
        return exc.rich_status()
    if isinstance(exc, grpc.aio.AioRpcError):
        rich = _rich_status(exc)
        if rich is not None:
            return rich
        details = exc.details() or "upstream error"
        return status_pb2.Status(code=exc.code().value[0], message=details)
    logger.error("unhandled error in gRPC handler", exc_info=exc)
    return status_pb2.Status(
        code=grpc.StatusCode.INTERNAL.value[0], message=f"internal error: {type(exc).__name__}"
    )


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    status = rpc_status.to_status(status_of(exc))
    await context.abort(status.code, status.details, status.trailing_metadata)


def grpc_errors(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Map domain exceptions raised by a servicer method to gRPC statuses."""
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in handler(self, request, context):
                    yield item
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - the one mapping point
                await _abort(context, exc)

        return stream_wrapper

    @functools.wraps(handler)
    async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the one mapping point
            await _abort(context, exc)

    return unary_wrapper
