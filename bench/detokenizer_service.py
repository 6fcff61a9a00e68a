"""The real detokenizer as a subprocess on a free loopback port, for tests and benchmarks.

Started with ``python -m services.detokenizer``; stopped by its own PID (SIGTERM,
then SIGKILL), never by name.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.rpc.server import READINESS_SERVICE
from services.launch import free_port


class DetokenizerProcess:
    def __init__(self, model: str | Path, args: Sequence[str] = (), log: Path | None = None):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "services.detokenizer",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "WARNING",
            *args,
        ]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> DetokenizerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 90.0) -> None:
        out = open(self.log, "wb") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _wait_ready(self, deadline: float) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=READINESS_SERVICE)
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"detokenizer exited with {self.proc.returncode}")
                try:
                    if (
                        stub.Check(request, timeout=1).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError("detokenizer not ready in time")
