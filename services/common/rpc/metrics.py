"""Per-RPC Prometheus metrics for grpc.aio servers, as a server interceptor.

Names and labels follow go-grpc-prometheus so the usual dashboards and alerts
(error ratio by ``grpc_code``, latency by ``grpc_method``) work unchanged.

Message counting: a unary request counts as one received message when the
handler starts and a unary response as one sent message when the handler
returns normally; streamed messages count as the handler pulls them from the
request iterator or yields them. Messages moved with ``context.read()`` /
``context.write()`` are not seen by the interceptor and are not counted.
Synchronous (thread-pool) behaviors are passed through unmeasured.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

_LABELS = ("grpc_service", "grpc_method", "grpc_type")
# Sub-millisecond unary calls up to five-minute generation streams.
_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_BUCKETS += (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RpcMetrics:
    """The metric families; one instance per registry, since names must be unique there."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        prefix = "tokenline_grpc_server"
        self.started = Counter(
            f"{prefix}_started", "RPCs started on the server.", _LABELS, registry=registry
        )
        self.handled = Counter(
            f"{prefix}_handled",
            "RPCs completed on the server, by status code.",
            (*_LABELS, "grpc_code"),
            registry=registry,
        )
        self.handling_seconds = Histogram(
            f"{prefix}_handling_seconds",
            "Time from handler start to completion.",
            _LABELS,
            buckets=_BUCKETS,
            registry=registry,
        )
        self.msg_received = Counter(
            f"{prefix}_msg_received", "Request messages received.", _LABELS, registry=registry
        )
        self.msg_sent = Counter(
            f"{prefix}_msg_sent", "Response messages sent.", _LABELS, registry=registry
        )


def _split_method(full_method: str) -> tuple[str, str]:
    """'/pkg.Service/Method' -> ('pkg.Service', 'Method')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method


def _rpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    return "server_stream" if handler.response_streaming else "unary"


def _code_name(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The status the client sees; context.code() is None unless set_code()/abort() ran."""
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        # GeneratorExit: grpc stopped pulling a response stream, i.e. the client went away.
        return grpc.StatusCode.CANCELLED.name
    if error is not None and not isinstance(error, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN.name
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return (grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN).name


_FACTORIES = {
    "unary": grpc.unary_unary_rpc_method_handler,
    "server_stream": grpc.unary_stream_rpc_method_handler,
    "client_stream": grpc.stream_unary_rpc_method_handler,
    "bidi_stream": grpc.stream_stream_rpc_method_handler,
}


class _MethodMetrics:
    """One method's labelled series, looked up once instead of on every call."""

    def __init__(self, metrics: RpcMetrics, labels: tuple[str, str, str]) -> None:
        self._metrics, self._labels = metrics, labels
        self.started = metrics.started.labels(*labels)
        self.received = metrics.msg_received.labels(*labels)
        self.sent = metrics.msg_sent.labels(*labels)
        self.seconds = metrics.handling_seconds.labels(*labels)
        self._handled: dict[str, Counter] = {}

    def handled(self, code: str) -> Counter:
        if code not in self._handled:
            self._handled[code] = self._metrics.handled.labels(*self._labels, code)
        return self._handled[code]


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Records started/handled counts, latency and message counts for every RPC.

    The measuring handler is built once per method and reused: a method's behavior
    and labels never change while the server runs.
    """

    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics
        self._wrapped: dict[str, tuple[Callable, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        behavior = (
            handler.stream_stream
            or handler.stream_unary
            or handler.unary_stream
            or handler.unary_unary
        )
        cached = self._wrapped.get(handler_call_details.method)
        if cached is not None and cached[0] is behavior:
            return cached[1]
        wrapped = self._wrap(handler, behavior, handler_call_details.method)
        self._wrapped[handler_call_details.method] = (behavior, wrapped)
        return wrapped

    def _wrap(
        self, handler: grpc.RpcMethodHandler, behavior: Callable, method: str
    ) -> grpc.RpcMethodHandler:
        is_gen = inspect.isasyncgenfunction(behavior)
        if not (is_gen or inspect.iscoroutinefunction(behavior)):
            return handler  # sync behaviors run in grpc's thread pool; don't move them.
        rpc_type = _rpc_type(handler)
        metered = _Metered(
            _MethodMetrics(self._metrics, (*_split_method(method), rpc_type)), handler, behavior
        )
        return _FACTORIES[rpc_type](
            metered.generator if is_gen else metered.coroutine,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class _Metered:
    """One method's behavior with its calls counted: started, each message received
    and sent, and how it ended, with its duration."""

    def __init__(
        self, metrics: _MethodMetrics, handler: grpc.RpcMethodHandler, behavior: Callable
    ) -> None:
        self.m = metrics
        self.handler = handler
        self.behavior = behavior

    def _begin(self, request: Any) -> tuple[Any, float]:
        self.m.started.inc()
        if not self.handler.request_streaming:
            self.m.received.inc()
            return request, time.perf_counter()
        return self._counted(request), time.perf_counter()

    async def _counted(self, request: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in request:
            self.m.received.inc()
            yield message

    def _finish(
        self, context: grpc.aio.ServicerContext, error: BaseException | None, start: float
    ) -> None:
        self.m.handled(_code_name(context, error)).inc()
        self.m.seconds.observe(time.perf_counter() - start)

    async def generator(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        request, start = self._begin(request)
        error: BaseException | None = None
        try:
            async for response in self.behavior(request, context):
                self.m.sent.inc()
                yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finish(context, error, start)

    async def coroutine(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        request, start = self._begin(request)
        error: BaseException | None = None
        try:
            response = await self.behavior(request, context)
            if not self.handler.response_streaming:
                self.m.sent.inc()
            return response
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finish(context, error, start)
