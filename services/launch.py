"""Run the whole stack as local processes on loopback (`make run`, `tokenline serve`).

Also the harness the integration tests use: ``LocalStack`` starts the four
services as subprocesses on given ports, waits for each to be ready, and
stops exactly the processes it started (by PID).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenline.v1 import (
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

from services.common import flags_doc
from services.common.envs import env_default
from services.common.rpc.server import READINESS_SERVICE
from services.common.tls import TlsSettings, add_tls_flags, open_sync_channel, pop_tls_settings
from services.launch_flags import add_service_flags, check, route

# Readiness probes retry a refused connection within 0.2 s instead of backing off, and
# ask again every 50 ms: a stack is used the moment it is ready.
_PROBE_INTERVAL_S = 0.05
_PROBE_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 200),
)


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out by itself (Linux's setting; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_UNEPHEMERAL_PORTS = (10240, max(_ephemeral_floor(), 10240 + 2 * 256))
_PORT_BLOCK = 256
_PORT_WALK = itertools.count()
_PICK_LOCK = threading.Lock()


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free right now, for services started next.

    Picked below the kernel's ephemeral range: a port handed out by ``bind(0)`` comes from
    that range, and between its pick and the service's own bind, any outgoing connection
    (a gRPC client of the same stack dialling its detokenizer) may take it as its local
    port (seen in CI: a detokenizer's metrics port, EADDRINUSE). Each process walks a block
    of its own (by PID) so concurrent pickers rarely meet, and every socket stays bound
    until all are picked: bound and closed one at a time, the same port could come twice,
    and two gRPC servers on one port both bind it (SO_REUSEPORT) and split its calls."""
    with _PICK_LOCK, contextlib.ExitStack() as held:
        ports: list[int] = []
        low, high = _UNEPHEMERAL_PORTS
        block = low + (os.getpid() * _PORT_BLOCK) % max(high - low - _PORT_BLOCK, 1)
        for _ in range(_PORT_BLOCK):
            if len(ports) == count:
                return ports
            port = block + next(_PORT_WALK) % _PORT_BLOCK
            sock = held.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use (or lingering in TIME_WAIT): the next one
                continue
            ports.append(port)
        # A crowded block: let the kernel pick the rest from its own range.
        while len(ports) < count:
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def free_port() -> int:
    return free_ports(1)[0]


@dataclass(frozen=True, slots=True)
class StackPorts:
    frontend: int = 50051
    scheduler: int = 50052
    detokenizer: int = 50053
    gateway: int = 8000  # also serves the gateway's own /metrics
    # Prometheus /metrics of each gRPC service (0 disables).
    frontend_metrics: int = 9101
    scheduler_metrics: int = 9102
    detokenizer_metrics: int = 9103

    @classmethod
    def free(cls) -> StackPorts:
        return cls(*free_ports(len(fields(cls))))

    def metrics_url(self, name: str, host: str = "127.0.0.1") -> str:
        port = self.gateway if name == "gateway" else getattr(self, f"{name}_metrics")
        return f"http://{host}:{port}/metrics"


@dataclass
class LocalStack:
    model: str
    ports: StackPorts = field(default_factory=StackPorts)
    host: str = "127.0.0.1"
    scheduler_args: list[str] = field(default_factory=list)
    frontend_args: list[str] = field(default_factory=list)
    detokenizer_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    # TLS (and mTLS) on every gRPC hop, given to all four as --tls-* flags; None: plaintext.
    tls: TlsSettings | None = None
    # The cluster token every service presents and requires (--cluster-token-file);
    # the stack's own info calls present it too. None: internal RPCs stay open.
    cluster_token_file: Path | None = None
    log_dir: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.ports.gateway}/v1"

    def addr(self, name: str) -> str:
        return f"{self.host}:{getattr(self.ports, name)}"

    def commands(self) -> dict[str, list[str]]:
        """Each service's command line, in start order."""
        detok, sched = self.addr("detokenizer"), self.addr("scheduler")
        tls = self._shared_args()
        gateway = ["--host", self.host, "--port", str(self.ports.gateway)]
        gateway += ["--frontend-addr", self.addr("frontend"), *tls, *self.gateway_args]
        return {
            "detokenizer": self._service("detokenizer", self.detokenizer_args),
            "scheduler": self._service(
                "scheduler", ["--detokenizer-addr", detok, *self.scheduler_args]
            ),
            "frontend": self._service(
                "frontend",
                ["--scheduler-addrs", sched, "--detokenizer-addr", detok, *self.frontend_args],
            ),
            "gateway": [sys.executable, "-m", "gateway", *gateway],
        }

    def _service(self, name: str, extra: list[str]) -> list[str]:
        """``python -m services.<name>`` with the flags every gRPC service shares."""
        tls = self._shared_args()
        return [
            *(sys.executable, "-m", f"services.{name}", "--model", self.model),
            *("--host", self.host, *tls),
            *("--port", str(getattr(self.ports, name))),
            *("--metrics-port", str(getattr(self.ports, f"{name}_metrics"))),
            *extra,
        ]

    def _shared_args(self) -> list[str]:
        """TLS and cluster token flags, the same for all four."""
        args = self.tls.to_args() if self.tls is not None else []
        if self.cluster_token_file is not None:
            args += ["--cluster-token-file", str(self.cluster_token_file)]
        return args

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """What the stack's own info calls present: the cluster token, if there is one."""
        if self.cluster_token_file is None:
            return ()
        return (("authorization", f"Bearer {self.cluster_token_file.read_text().strip()}"),)

    def start(self, timeout: float = 120.0, only: tuple[str, ...] = ()) -> None:
        """Start the four (or ``only`` those named: a second stack can add replicas that
        share the first one's detokenizer) and wait until each is ready."""
        names = only or tuple(self.commands())
        try:
            for name in names:
                self.procs[name] = subprocess.Popen(self.commands()[name], **self._output(name))
            deadline = time.monotonic() + timeout
            for name in ("detokenizer", "scheduler", "frontend"):
                if name in names:
                    self._wait_grpc_ready(name, deadline)
            if "gateway" in names:
                self._wait_http_ready(deadline)
        except BaseException:
            self.stop()
            raise

    def kill(self, name: str) -> None:
        """SIGKILL one service we started, as a crash would end it; ``restart`` revives it."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def restart(self, name: str, timeout: float = 60.0) -> None:
        """Start one service again on its own ports and wait until it is ready."""
        output = self._output(name, mode="ab")  # keep what the crashed one wrote
        self.procs[name] = subprocess.Popen(self.commands()[name], **output)
        deadline = time.monotonic() + timeout
        if name == "gateway":
            self._wait_http_ready(deadline)
        else:
            self._wait_grpc_ready(name, deadline)

    def _output(self, name: str, mode: str = "wb") -> dict:
        if self.log_dir is None:
            return {}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return {"stdout": open(self.log_dir / f"{name}.log", mode), "stderr": subprocess.STDOUT}

    def frontend_info(self) -> frontend_pb2.FrontendInfo:
        with open_sync_channel(self.addr("frontend"), self.tls) as channel:
            stub = frontend_pb2_grpc.FrontendServiceStub(channel)
            request = frontend_pb2.FrontendInfoRequest()
            return stub.GetInfo(request, timeout=5, metadata=self._metadata())

    def scheduler_info(self) -> scheduler_pb2.SchedulerInfo:
        with open_sync_channel(self.addr("scheduler"), self.tls) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            request = scheduler_pb2.ServerInfoRequest()
            return stub.GetInfo(request, timeout=5, metadata=self._metadata())

    def detokenizer_info(self) -> detokenizer_pb2.DetokenizerInfo:
        with open_sync_channel(self.addr("detokenizer"), self.tls) as channel:
            stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
            request = detokenizer_pb2.DetokenizerInfoRequest()
            return stub.GetInfo(request, timeout=5, metadata=self._metadata())

    def live_state(self) -> dict[str, int]:
        """What each gRPC service still holds for requests; all zero when none is in
        flight (KV in the prefix cache is not held)."""
        sched = self.scheduler_info()
        kv_held = sched.num_total_kv_tokens - sched.num_free_kv_tokens
        return {
            "frontend_requests": self.frontend_info().num_live_requests,
            "scheduler_requests": sched.num_waiting + sched.num_running,
            "kv_tokens_held": kv_held - sched.num_cached_kv_tokens,
            "decode_states": self.detokenizer_info().num_live_states,
        }

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up")

    def _wait_grpc_ready(self, name: str, deadline: float) -> None:
        # A service still importing refuses the connection; gRPC's reconnect backoff would
        # then grow toward 120 s and see it ready only seconds after it is. Poll instead.
        with open_sync_channel(self.addr(name), self.tls, _PROBE_OPTIONS) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self._check_alive(name)
                try:
                    reply = stub.Check(
                        health_pb2.HealthCheckRequest(service=READINESS_SERVICE), timeout=1
                    )
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(_PROBE_INTERVAL_S)
        raise TimeoutError(f"{name} not ready in time")

    def _wait_http_ready(self, deadline: float) -> None:
        url = f"http://{self.host}:{self.ports.gateway}/health"
        while time.monotonic() < deadline:
            self._check_alive("gateway")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(_PROBE_INTERVAL_S)
        raise TimeoutError("gateway not ready in time")

    def stop(self, timeout: float = 15.0, only: Sequence[str] | None = None) -> None:
        """SIGTERM each process we started (gateway first), then SIGKILL stragglers.

        ``only`` stops just those services, so stacks that share services can stop every
        caller before any callee: a service drains while a peer still holds a stream to it.
        """
        names = [n for n in ("gateway", "frontend", "scheduler", "detokenizer") if n in self.procs]
        if only is not None:
            names = [n for n in names if n in only]
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        for name in names:
            proc = self.procs.pop(name)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def create_parser() -> argparse.ArgumentParser:
    """The launcher's own flags; ``create_serve_parser`` adds every service's."""
    p = argparse.ArgumentParser(
        prog="tokenline serve",
        usage="%(prog)s [MODEL] [flags of the launcher and of any service]",
        description="run tokenline's four services as local processes. Every flag of the "
        "four services is taken too and handed to the services that take it (one several "
        "take goes to each), except each service's --port, --metrics-port and peer addresses, "
        "which the launcher sets (--gateway-port, --metrics-ports); --help lists them by "
        "service. A flag no service takes, or a value its service refuses, stops the launch "
        "before anything starts.",
        allow_abbrev=False,  # an abbreviation could name two services' flags
    )
    p.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL",
        help="Hugging Face model directory every service loads (or --model)",
    )
    p.add_argument(
        "--model",
        default=env_default("TOKENLINE_MODEL", "models/tokenline-tiny"),
        help="Hugging Face model directory every service loads",
    )
    p.add_argument("--host", default="127.0.0.1", help="address every service binds to")
    p.add_argument("--gateway-port", type=int, default=8000, help="the gateway's HTTP port")
    p.add_argument(
        "--metrics-ports",
        type=_metrics_ports,
        default=(9101, 9102, 9103),
        metavar="F,S,D",
        help="Prometheus ports of frontend, scheduler and detokenizer",
    )
    add_tls_flags(p)  # handed to all four services
    return p


def service_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each service's own parser, in the order docs/flags.md lists them."""
    names = LocalStack("").commands()
    parsers = {c.title: c.create_parser() for c in flags_doc.COMMANDS if c.title in names}
    if len(parsers) != len(names):  # a service without a parser would lose its flags
        raise RuntimeError(
            f"no parser in flags_doc.COMMANDS for {sorted(set(names) - set(parsers))}"
        )
    return parsers


def _wired_flags() -> dict[str, frozenset[str]]:
    """The flags ``LocalStack`` gives each service itself (model, ports, peer addresses)."""
    commands = LocalStack("MODEL").commands()
    return {name: frozenset(t for t in cmd if t.startswith("--")) for name, cmd in commands.items()}


def create_serve_parser(parsers: dict[str, argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = create_parser()
    add_service_flags(p, parsers, _wired_flags())
    p.epilog = (
        "Each service's --port, --metrics-port and peer addresses are set by the launcher "
        "(--gateway-port, --metrics-ports). A flag several services take goes to each."
    )
    return p


def stack_from_args(argv: list[str] | None) -> LocalStack:
    """The stack a command line asks for; a wrong flag or value exits here, naming it."""
    parsers = service_parsers()
    parser = create_serve_parser(parsers)
    args = parser.parse_args(argv)
    if args.model_dir not in (None, args.model) and args.model != parser.get_default("model"):
        parser.error("MODEL and --model name different models; give one")
    flags = route(args, list(parsers))
    check(parsers, flags)
    tls = pop_tls_settings(args)
    frontend_metrics, scheduler_metrics, detokenizer_metrics = args.metrics_ports
    ports = StackPorts(
        gateway=args.gateway_port,
        frontend_metrics=frontend_metrics,
        scheduler_metrics=scheduler_metrics,
        detokenizer_metrics=detokenizer_metrics,
    )
    return LocalStack(
        args.model_dir or args.model,
        ports,
        host=args.host,
        tls=tls if tls.is_enabled else None,
        scheduler_args=flags["scheduler"],
        frontend_args=flags["frontend"],
        detokenizer_args=flags["detokenizer"],
        gateway_args=flags["gateway"],
    )


def _metrics_ports(raw: str) -> tuple[int, int, int]:
    ports = tuple(int(p) for p in raw.split(","))
    if len(ports) != 3:
        raise ValueError("three comma-separated ports: frontend,scheduler,detokenizer")
    return ports


def main(argv: list[str] | None = None) -> None:
    stack = stack_from_args(argv)
    host = stack.host
    print("starting detokenizer, scheduler, frontend and gateway ...", flush=True)
    try:
        stack.start()
    except KeyboardInterrupt:
        raise SystemExit(130) from None  # Ctrl-C while starting: start() stopped them all
    except (RuntimeError, TimeoutError) as exc:
        raise SystemExit(f"tokenline did not start: {exc} (its output is above)") from None
    print(
        f"tokenline is serving {stack.model} at {stack.base_url}  (Ctrl-C stops all four)\n"
        "metrics: " + "  ".join(stack.ports.metrics_url(name, host) for name in stack.commands()),
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while all(p.poll() is None for p in stack.procs.values()):
            time.sleep(0.5)
        print("a service exited; stopping the rest", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
