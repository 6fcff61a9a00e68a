"""The real gateway under uvicorn for tests: a free loopback port, a background thread."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig


@dataclass(frozen=True)
class StrictGateway:
    """A gateway with auth on, a small body limit and a short deadline."""

    url: str
    api_key: str = "test-key"
    max_body_bytes: int = 4096
    timeout_s: float = 0.5

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


class GatewayServer:
    """The real gateway app under uvicorn on a free loopback port, in a thread."""

    def __init__(self, config: GatewayConfig) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        uv_config = uvicorn.Config(create_app(config), log_level="warning", lifespan="on")
        self._server = uvicorn.Server(uv_config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> GatewayServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
