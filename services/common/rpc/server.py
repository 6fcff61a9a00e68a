"""Shared gRPC process shell: health, reflection, metrics port, graceful drain."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Collection, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from services.common.rpc.decoding import RequestDecodingInterceptor
from services.common.rpc.drain import DrainGate
from services.common.rpc.metrics import RpcMetrics, RpcMetricsInterceptor
from services.common.tls import TlsSettings, add_port

logger = logging.getLogger(__name__)

# Readiness probes ask for this service name; liveness asks for "" (the server).
READINESS_SERVICE = "tokenline.readiness"

# A peer that vanishes without closing its connection (partition, frozen process) is
# noticed within about three seconds: the server pings every second, also when the peer
# sends no data (which would otherwise allow one ping per five minutes), and drops a
# connection whose ping goes unanswered for two, cancelling its RPCs. In this gRPC the
# unanswered ping is timed by ping_timeout_ms (default one minute), not keepalive_timeout
# alone. Leases do not rely on this: their renewals are the application's own signal.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_time_between_pings_ms", 1000),
]


@functools.cache
def default_rpc_metrics() -> RpcMetrics:
    """RPC metrics on the default registry, created once: a second registration would raise."""
    return RpcMetrics()


class GrpcProcess:
    """A grpc.aio server with the standard services, ready to serve until SIGTERM.

    Readiness (``READINESS_SERVICE`` and each registered service name) stays
    NOT_SERVING until ``set_ready(True)``; on SIGTERM every name flips to
    NOT_SERVING, new calls to ``work_methods`` (full paths) are refused with UNAVAILABLE
    (services/common/rpc/drain.py) and the work in flight gets ``drain_timeout``.
    The port serves TLS when ``tls`` turns it on (services/common/tls.py); ``interceptors``
    (authentication, services/common/auth/cluster_token.py) see every call after the metrics'.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        service_names: Sequence[str],
        metrics_port: int = 0,
        max_concurrent_rpcs: int | None = None,
        rpc_metrics: RpcMetrics | None = None,
        tls: TlsSettings | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        work_methods: Collection[str] = (),
    ) -> None:
        self.drain_gate = DrainGate(work_methods)
        self.rpc_metrics = rpc_metrics if rpc_metrics is not None else default_rpc_metrics()
        self.server = grpc.aio.server(
            # Metrics first, so a call the gate or auth refuses is still counted.
            interceptors=[
                RpcMetricsInterceptor(self.rpc_metrics),
                self.drain_gate,
                RequestDecodingInterceptor(),
                *interceptors,
            ],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                *KEEPALIVE_OPTIONS,
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.address = f"{host}:{port}"
        # TLS (and mTLS) when `tls` turns it on; plaintext otherwise.
        self.port = add_port(self.server, self.address, tls)
        self.metrics_port = metrics_port
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(False)
        if self.metrics_port:
            start_http_server(self.metrics_port, addr="0.0.0.0")
        logger.info("gRPC listening on port %d", self.port)

    async def set_ready(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in (READINESS_SERVICE, *self.service_names):
            await self.health.set(name, status)

    async def serve_until_signal(
        self,
        drain_timeout: float,
        on_drain: Callable[[], Awaitable[None]] | None = None,
        grace_after_drain: float | None = None,
    ) -> None:
        """Block until SIGTERM/SIGINT, then drain and stop: the gate refuses new work at
        once, ``on_drain`` finishes what the process holds, the work calls taken before
        end, and only then does grpc stop, so a call that comes during the drain is
        refused UNAVAILABLE by us, never CANCELLED by a racing shutdown. All of it shares
        ``drain_timeout``. ``grace_after_drain``: once the work is done, the calls still
        open get only this long: a service whose peers hold streams that never end by
        themselves (the scheduler's lease streams) would otherwise wait out the timeout."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self._stopping.wait()
        logger.info("draining for up to %.1fs", drain_timeout)
        deadline = loop.time() + drain_timeout
        self.drain_gate.close()
        await self.health.enter_graceful_shutdown()
        if on_drain is not None:
            await on_drain()
        drained = await self.drain_gate.wait_idle(max(0.0, deadline - loop.time()))
        grace = max(0.0, deadline - loop.time())
        if drained and grace_after_drain is not None:
            grace = min(grace, grace_after_drain)
        await self.server.stop(grace)

    def request_stop(self) -> None:
        self._stopping.set()


async def wait_until(predicate: Callable[[], bool], timeout: float, poll: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; returns whether it held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(poll)
    return True
