"""Domain errors and their one mapping onto gRPC status codes.

Domain code raises these; servicers wrap handlers with ``grpc_errors`` so no
handler converts exceptions itself and no traceback ever reaches a client.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


# The abort message the detokenizer gives requests whose scheduler stream ended.
SCHEDULER_STREAM_ENDED = "scheduler stream ended"


class TokenlineError(Exception):
    """Base class: a client-visible error with a gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def details(self) -> str:
        # The gateway extracts the field from the "field: " prefix for OpenAI's `param`.
        return f"{self.field}: {self.message}" if self.field else self.message


class InvalidArgumentError(TokenlineError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExistsError(TokenlineError):
    code = grpc.StatusCode.ALREADY_EXISTS


class NotFoundError(TokenlineError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhaustedError(TokenlineError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(TokenlineError):
    code = grpc.StatusCode.UNAVAILABLE


class RequestAbortedError(TokenlineError):
    code = grpc.StatusCode.ABORTED


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, TokenlineError):
        await context.abort(exc.code, exc.details())
    if isinstance(exc, grpc.aio.AioRpcError):
        # An upstream service failed: pass its status on, not a traceback.
        await context.abort(exc.code(), exc.details() or "upstream error")
    logger.exception("unhandled error in gRPC handler")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


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
