"""Fixtures: one FAKE frontend and two real gateways (open, strict) served by uvicorn."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_frontend import FakeFrontend, FakeFrontendServicer
from gateway_harness import GatewayServer, StrictGateway

from gateway.config import GatewayConfig


@pytest.fixture(scope="session")
def fake_frontend() -> Iterator[FakeFrontend]:
    fake = FakeFrontend().start()
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def gateway_url(fake_frontend: FakeFrontend) -> Iterator[str]:
    """Auth off, 1 MiB body limit, 10 s deadline."""
    config = GatewayConfig(
        frontend_addr=fake_frontend.address, max_body_bytes=1 << 20, request_timeout_s=10.0
    )
    server = GatewayServer(config).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session", params=["multiplex", "per-request"])
def stream_gateway_url(
    request: pytest.FixtureRequest, fake_frontend: FakeFrontend
) -> Iterator[str]:
    """A gateway like `gateway_url`, once per way streams reach the frontend: all on one
    Multiplex call (the default), or one server-streaming RPC each (`--no-multiplex`)."""
    config = GatewayConfig(
        frontend_addr=fake_frontend.address,
        max_body_bytes=1 << 20,
        request_timeout_s=10.0,
        multiplex=request.param == "multiplex",
    )
    server = GatewayServer(config).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def keepalive_gateway_url(fake_frontend: FakeFrontend) -> Iterator[str]:
    """A gateway like `gateway_url` whose silent streams get a keep-alive every 50 ms."""
    config = GatewayConfig(
        frontend_addr=fake_frontend.address,
        max_body_bytes=1 << 20,
        request_timeout_s=10.0,
        sse_keepalive_s=0.05,
    )
    server = GatewayServer(config).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def strict_gateway(fake_frontend: FakeFrontend) -> Iterator[StrictGateway]:
    spec = StrictGateway(url="")
    config = GatewayConfig(
        frontend_addr=fake_frontend.address,
        api_key=spec.api_key,
        max_body_bytes=spec.max_body_bytes,
        request_timeout_s=spec.timeout_s,
    )
    server = GatewayServer(config).start()
    yield StrictGateway(url=server.url)
    server.stop()


@pytest.fixture(autouse=True)
def fake(fake_frontend: FakeFrontend) -> FakeFrontendServicer:
    """The fake servicer, reset to "answer everything" before each test."""
    fake_frontend.servicer.reset()
    fake_frontend.set_serving(True)
    return fake_frontend.servicer
