"""The servers `compare` starts: tokenline's four services and `transformers serve`.

Each is a context manager that starts its processes on free loopback ports, waits
until they answer, and on exit stops exactly the processes it started, by PID.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from services.launch import LocalStack, StackPorts, free_port

LOG_TAIL_CHARS = 3000


class ServerStartError(RuntimeError):
    """A server could not be started; the message says why."""


def log_tail(path: Path) -> str:
    if not path.exists():
        return ""
    return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def last_line(text: str) -> str:
    """The last non-empty line: for a Python server that died, its exception."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


class TokenlineServer:
    """tokenline via `LocalStack`: scheduler in `dtype` on `device`, plus `extra_args`."""

    label = "tokenline"

    def __init__(
        self,
        model_dir: str,
        dtype: str,
        device: str,
        extra_args: str,
        log_dir: Path,
        timeout: float,
    ) -> None:
        scheduler_args = ["--dtype", dtype, "--device", device, *shlex.split(extra_args)]
        self.stack = LocalStack(
            model_dir, StackPorts.free(), scheduler_args=scheduler_args, log_dir=log_dir
        )
        self.model = Path(model_dir).resolve().name
        self.log_dir = log_dir
        self.timeout = timeout

    @property
    def base_url(self) -> str:
        return self.stack.base_url

    def __enter__(self) -> TokenlineServer:
        try:
            self.stack.start(timeout=self.timeout)
        except (RuntimeError, TimeoutError) as exc:
            logs = "".join(
                f"---- {p.name}\n{log_tail(p)}" for p in sorted(self.log_dir.glob("*.log"))
            )
            raise ServerStartError(f"tokenline did not start: {exc}\n{logs}") from exc
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stack.stop()


def transformers_cli() -> str:
    """The `transformers` console script of this interpreter's environment, else PATH's."""
    beside = Path(sys.executable).parent / "transformers"
    found = str(beside) if beside.exists() else shutil.which("transformers")
    if found is None:
        raise ServerStartError("the `transformers` CLI is not installed (pip install transformers)")
    return found


class TransformersServer:
    """`transformers serve --continuous-batching MODEL_DIR`, offline (HF_HUB_OFFLINE=1).

    It is pinned to the model directory (the positional FORCE_MODEL), so requests must
    name the model exactly as given. Ready when GET /health answers: it loads the
    model before it listens.
    """

    label = "transformers"

    def __init__(
        self,
        model_dir: str,
        dtype: str,
        device: str,
        extra_args: str,
        log_dir: Path,
        timeout: float,
    ) -> None:
        self.model = model_dir
        self.port = free_port()
        self.host = "127.0.0.1"
        self.cmd = [
            transformers_cli(), "serve", "--continuous-batching",
            "--host", self.host, "--port", str(self.port),
            "--dtype", dtype, "--device", device, *shlex.split(extra_args), model_dir,
        ]  # fmt: skip
        self.log_path = log_dir / "transformers-serve.log"
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> TransformersServer:
        if importlib.util.find_spec("accelerate") is None:
            raise ServerStartError(
                "`transformers serve` loads models with a device_map, which needs the "
                "`accelerate` package: pip install accelerate (pinned in the dev extra)"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(self.proc)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.timeout
        url = f"http://{self.host}:{self.port}/health"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_tail(self.log_path)
                raise ServerStartError(
                    f"`transformers serve` exited with code {proc.returncode} before it "
                    f"was ready ({shlex.join(self.cmd)}):\n{tail}\nreason: {last_line(tail)}"
                )
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerStartError(f"`transformers serve` not ready in {self.timeout:.0f}s")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """SIGTERM our process, SIGKILL it if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
