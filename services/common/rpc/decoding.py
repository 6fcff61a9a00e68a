"""A request that is not a valid message of its type (a string field holding invalid
UTF-8, a truncated field) is the client's error: INVALID_ARGUMENT. Left to grpc, a
request that fails to deserialize ends INTERNAL ("Exception deserializing request!")."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.common.rpc.handlers import wrap_behavior


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _abort_message(request: _Undecodable) -> str:
    return f"the request is not a valid message of its type: {request.reason}"


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):
    """Unary requests that fail to parse end with INVALID_ARGUMENT before any handler
    runs. (A bad message inside a request stream still ends that call as grpc decides.)"""

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer

        def tolerant(data: bytes) -> Any:
            try:
                return decode(data)
            except DecodeError as exc:
                return _Undecodable(str(exc))

        def unary(behavior: Any) -> Any:
            async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _abort_message(request))
                return await behavior(request, context)

            return run

        def streaming(behavior: Any) -> Any:
            async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _abort_message(request))
                async for item in behavior(request, context):
                    yield item

            return run

        return wrap_behavior(handler, unary, streaming)._replace(request_deserializer=tolerant)
