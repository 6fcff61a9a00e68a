"""End-to-end checks of a running compose cluster; deploy/containers-test.sh calls this.

The shell script builds the image and runs `docker-compose up -d`; this module then talks
to the cluster the way users do, over loopback only: the official openai SDK against the
published gateway port, a gRPC client against the published frontend port, `docker exec`
to scrape every service's /metrics from inside the compose network (where Prometheus
scrapes), `docker kill` of the scheduler under load, and finally `docker-compose down -v`.
It prints a short report and exits 1 when any check fails. Not collected by pytest.

    .venv/bin/python deploy/containers_check.py --project tokenline-ct --up-started-at T0
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenline.v1 import frontend_pb2, frontend_pb2_grpc, openai_pb2

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("detokenizer", "scheduler", "frontend", "gateway")
APP_UID = "10001"
PROMPT = [{"role": "user", "content": "Say hello to the containers."}]
NUM_LOAD_STREAMS = 8


class CheckFailed(Exception):
    """A check's verdict: the message says what was expected and what was seen."""


@dataclass
class Cluster:
    """The compose project under test, reached through `docker` and loopback ports."""

    project: str
    image: str
    http_port: int
    grpc_port: int
    docker: str = field(default_factory=lambda: os.environ.get("DOCKER", "docker"))
    model: str = ""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def run(self, *argv: str, timeout: float = 120) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise CheckFailed(f"`{' '.join(argv[:4])} …` failed: {done.stderr.strip()[-500:]}")
        return done.stdout

    def compose(self, *args: str, timeout: float = 180) -> str:
        return self.run(
            "docker-compose", "--project-name", self.project, "--project-directory", str(ROOT),
            "--file", str(ROOT / "docker-compose.yml"), *args, timeout=timeout,
        )  # fmt: skip

    def containers(self) -> dict[str, list[str]]:
        """Service name -> ids of every container (running or not) in the project."""
        out = self.run(
            self.docker, "ps", "--all", "--no-trunc",
            "--filter", f"label=com.docker.compose.project={self.project}",
            "--format", '{{.ID}} {{.Label "com.docker.compose.service"}}',
        )  # fmt: skip
        found: dict[str, list[str]] = {}
        for line in out.split("\n"):
            if line.strip():
                cid, service = line.split()
                found.setdefault(service, []).append(cid)
        return found

    def container(self, service: str) -> str:
        ids = self.containers().get(service, [])
        if len(ids) != 1:
            raise CheckFailed(f"{service}: expected one container, found {len(ids)}")
        return ids[0]

    def inspect(self, cid: str) -> dict:
        return json.loads(self.run(self.docker, "inspect", cid))[0]

    def openai_client(self, timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.base_url, api_key="unused", max_retries=0, timeout=timeout
        )


# ---------------------------------------------------------------------------
# Checks: each returns a one-line detail for the report or raises CheckFailed.


def check_image(cluster: Cluster, build_seconds: int) -> str:
    info = json.loads(cluster.run(cluster.docker, "image", "inspect", cluster.image))[0]
    if info["Config"]["User"] != f"{APP_UID}:{APP_UID}":
        raise CheckFailed(f"image user is {info['Config']['User']!r}, not {APP_UID}")
    history = cluster.run(
        cluster.docker, "history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}",
        cluster.image,
    )  # fmt: skip
    layers = [line.split("\t", 1) for line in history.rstrip("\n").split("\n")]
    biggest = sorted(layers, key=lambda layer: _bytes(layer[0]), reverse=True)[:3]
    parts = ", ".join(f"{_layer_name(cmd)} {size}" for size, cmd in biggest)
    built = f"; built in {build_seconds} s" if build_seconds >= 0 else ""
    return f"{info['Size'] / 1e6:,.0f} MB, user {APP_UID}; largest layers: {parts}{built}"


def _bytes(size: str) -> float:
    units = {"kB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1}
    for unit, scale in units.items():
        if size.endswith(unit):
            return float(size[: -len(unit)]) * scale
    return 0.0


def _layer_name(created_by: str) -> str:
    """What a layer holds: a COPY's destination, the base image, or the command's start."""
    text = created_by.removeprefix("/bin/sh -c ").removeprefix("#(nop) ").strip()
    if not text:
        return "base image"
    if text.startswith("COPY ") and " in " in text:
        return text.rsplit(" in ", 1)[1].strip()
    return text[:40]


def check_startup(cluster: Cluster, up_started_at: float) -> str:
    _wait_for(lambda: _http_status(cluster.base_url.removesuffix("/v1") + "/health") == 200, 300)
    health = time.time()
    cluster.model = cluster.openai_client().models.list().data[0].id
    stream = cluster.openai_client().chat.completions.create(
        model=cluster.model, messages=PROMPT, max_tokens=4, stream=True
    )
    first_token = None
    for chunk in stream:
        if first_token is None and chunk.choices and chunk.choices[0].delta.content:
            first_token = time.time()
    if first_token is None:
        raise CheckFailed("the first stream carried no content")
    init = cluster.inspect(cluster.container("model-init"))["State"]["FinishedAt"]
    return (
        f"`docker-compose up -d` → model-init done {_epoch(init) - up_started_at:.1f} s, "
        f"→ gateway /health 200 {health - up_started_at:.1f} s, "
        f"→ first streamed token {first_token - up_started_at:.1f} s"
    )


def _epoch(docker_time: str) -> float:
    """Docker's RFC 3339 time with nanoseconds, as epoch seconds."""
    stamp, _, fraction = docker_time.rstrip("Z").partition(".")
    whole = datetime.datetime.fromisoformat(stamp).replace(tzinfo=datetime.UTC)
    return whole.timestamp() + float(f"0.{fraction or 0}")


def _wait_for(predicate: Callable[[], bool], timeout: float, every: float = 0.5) -> float:
    """Poll until ``predicate`` holds; returns the monotonic time it was first seen to hold."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(every)
    raise CheckFailed(f"not ready within {timeout:.0f} s")


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def check_containers(cluster: Cluster) -> str:
    found = cluster.containers()
    if sorted(found) != sorted(["model-init", *SERVICES]):
        raise CheckFailed(f"services with containers: {sorted(found)}")
    init = cluster.inspect(cluster.container("model-init"))["State"]
    if init["Status"] != "exited" or init["ExitCode"] != 0:
        raise CheckFailed(f"model-init: {init['Status']}, exit code {init['ExitCode']}")
    for service in SERVICES:
        cid = cluster.container(service)
        _wait_for(lambda cid=cid: _health(cluster, cid) == "healthy", 120)
        status = cluster.run(cluster.docker, "exec", cid, "cat", "/proc/1/status")
        uid = next(line.split()[1] for line in status.split("\n") if line.startswith("Uid:"))
        if uid != APP_UID:
            raise CheckFailed(f"{service}: PID 1 runs as uid {uid}, not {APP_UID}")
    return f"model-init exited 0; {', '.join(SERVICES)}: one container each, healthy, uid {APP_UID}"


def _health(cluster: Cluster, cid: str) -> str:
    state = cluster.inspect(cid)["State"]
    return state.get("Health", {}).get("Status", state["Status"])


def check_kernels(cluster: Cluster) -> str:
    """The scheduler runs on the kernels built into the image for its CPU's ISA level (not
    on the eager paths), compiled nothing at start, and the image has no C++ compiler."""
    logs = cluster.compose("logs", "--no-color", "scheduler")
    if "sampler and decode attention: compiled kernels" not in logs:
        tail = "\n".join(line for line in logs.splitlines() if "kernel" in line)[-2000:]
        raise CheckFailed(f"the scheduler runs without its compiled kernels:\n{tail}")
    if "compiling the CPU kernels" in logs:
        raise CheckFailed("the scheduler compiled kernels at start; the image's should serve")
    loaded = [line for line in logs.splitlines() if "CPU kernels for " in line]
    if not loaded or "/opt/tokenline/kernels/" not in loaded[0]:
        raise CheckFailed(f"kernels not loaded from the image's folder: {loaded}")
    scheduler = cluster.container("scheduler")
    compilers = cluster.run(
        cluster.docker,
        "exec",
        scheduler,
        "sh",
        "-c",
        "command -v g++ c++ gcc cc || true",
    ).split()
    if compilers:
        raise CheckFailed(f"the runtime image carries a compiler: {compilers}")
    shipped = cluster.run(
        cluster.docker, "exec", scheduler, "sh", "-c", "ls /opt/tokenline/kernels"
    ).split()
    level = loaded[0].partition("CPU kernels for ")[2].partition(" ")[0]
    return f"level {level} loaded from the image (no compiler in it); shipped: {', '.join(shipped)}"


def check_openai_chat(cluster: Cluster) -> str:
    client = cluster.openai_client()
    request = {"model": cluster.model, "messages": PROMPT, "max_tokens": 16, "temperature": 0}
    unary = client.chat.completions.create(**request)
    text = unary.choices[0].message.content or ""
    if not text or unary.usage.completion_tokens < 1:
        raise CheckFailed(f"unary reply carried no text: {unary}")
    deltas, usage = [], None
    for chunk in client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    ):
        deltas += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    if "".join(deltas) != text:
        raise CheckFailed(f"stream text {''.join(deltas)!r} != unary text {text!r}")
    if usage is None or usage.completion_tokens != unary.usage.completion_tokens:
        raise CheckFailed(f"stream usage {usage} != unary usage {unary.usage}")
    return (
        f"unary {unary.usage.completion_tokens} tokens ({unary.choices[0].finish_reason}); "
        f"stream of {len(deltas)} deltas equals it, usage chunk included"
    )


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def check_structured_output(cluster: Cluster) -> str:
    """xgrammar in the image: the CPU image ships without triton, which only GPUs use."""
    reply = cluster.openai_client().chat.completions.create(
        model=cluster.model, messages=PROMPT, max_tokens=64, temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA},
        },
    )  # fmt: skip
    text = reply.choices[0].message.content or ""
    try:
        answer = json.loads(text)["answer"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckFailed(f"reply {text!r} does not follow the schema ({exc})") from exc
    if answer not in ("yes", "no"):
        raise CheckFailed(f"answer {answer!r} is not in the schema's enum")
    return f"json_schema response_format: {text!r} ({reply.choices[0].finish_reason})"


def check_grpc_frontend(cluster: Cluster) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tokenline.readiness"), timeout=5
        )
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            raise CheckFailed(f"frontend readiness: {health.status}")
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        models = stub.ListModels(frontend_pb2.ListModelsRequest(), timeout=10)
        reply = stub.ChatCompletion(
            openai_pb2.ChatCompletionRequest(
                model=cluster.model,
                messages=[openai_pb2.ChatMessage(role="user", content=PROMPT[0]["content"])],
                sampling=openai_pb2.OpenAISampling(temperature=0, max_tokens=8),
            ),
            timeout=60,
        )
    choice = reply.choices[0]
    if reply.usage.completion_tokens < 1:
        raise CheckFailed(f"ChatCompletion over gRPC produced no tokens: {reply}")
    return (
        f"127.0.0.1:{cluster.grpc_port} readiness SERVING, ListModels "
        f"{[m.id for m in models.data]}, ChatCompletion {reply.usage.completion_tokens} tokens "
        f"({choice.finish_reason})"
    )


SCRAPE = """
import json, sys, urllib.request
out = {}
for target in sys.argv[1:]:
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as reply:
        body = reply.read().decode()
    out[target] = [reply.status, len(body),
                   sum(1 for l in body.splitlines() if l.startswith("tokenline_"))]
print(json.dumps(out))
"""


def check_metrics(cluster: Cluster) -> str:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]  # fmt: skip
    # From inside the compose network, by service name, as Prometheus scrapes.
    out = cluster.run(
        cluster.docker, "exec", cluster.container("gateway"), "python", "-c", SCRAPE, *targets
    )
    scraped = json.loads(out)
    for target, (status, _, num_series) in scraped.items():
        if status != 200 or num_series == 0:
            raise CheckFailed(f"{target}/metrics: HTTP {status}, {num_series} tokenline_ series")
    host_status = _http_status(f"http://127.0.0.1:{cluster.http_port}/metrics")
    if host_status != 200:
        raise CheckFailed(f"gateway /metrics from the host: HTTP {host_status}")
    counts = ", ".join(f"{t} {n}" for t, (_, _, n) in scraped.items())
    return f"tokenline_ samples per target: {counts}; gateway /metrics from the host 200"


@dataclass
class StreamOutcome:
    num_chunks: int = 0
    error: str = ""
    ended_at: float = 0.0
    completed: bool = False


def _load_stream(cluster: Cluster, outcome: StreamOutcome, started: threading.Event) -> None:
    try:
        stream = cluster.openai_client(timeout=60).chat.completions.create(
            model=cluster.model, messages=PROMPT, max_tokens=3000, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for _ in stream:
            outcome.num_chunks += 1
            if outcome.num_chunks == 2:
                started.set()
        outcome.completed = True
    except openai.OpenAIError as exc:
        outcome.error = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"
    finally:
        outcome.ended_at = time.monotonic()
        started.set()


def _kill_under_load(cluster: Cluster, kill: Callable[[], object]) -> tuple[float, str]:
    """Start the load streams, call ``kill`` once each has tokens, and judge the streams.

    Returns the monotonic time of the kill and a summary of how the streams ended.
    """
    outcomes = [StreamOutcome() for _ in range(NUM_LOAD_STREAMS)]
    events = [threading.Event() for _ in outcomes]
    threads = [
        threading.Thread(target=_load_stream, args=(cluster, o, e), daemon=True)
        for o, e in zip(outcomes, events, strict=True)
    ]
    for thread in threads:
        thread.start()
    for event in events:
        if not event.wait(120):
            raise CheckFailed("the load streams did not start within 120 s")
    killed_at = time.monotonic()  # before the call: streams may fail before it returns
    kill()
    for thread in threads:
        thread.join(timeout=60)
    _judge_killed_streams(outcomes, killed_at)
    errors = "; ".join(sorted({o.error for o in outcomes}))
    last = max(o.ended_at for o in outcomes) - killed_at
    return (
        killed_at,
        f"{NUM_LOAD_STREAMS} streams in flight got an error within {last:.1f} s ({errors})",
    )


def check_scheduler_crash(cluster: Cluster) -> str:
    """A crash (SIGKILL of the container's main process, as the OOM killer would send):
    `restart: unless-stopped` brings the scheduler back by itself."""
    scheduler = cluster.container("scheduler")
    state = cluster.inspect(scheduler)
    restarts, pid = state["RestartCount"], state["State"]["Pid"]
    killed_at, streams = _kill_under_load(cluster, lambda: os.kill(pid, signal.SIGKILL))
    recovered, num_refused = _first_success(cluster)
    restarted = cluster.inspect(scheduler)["RestartCount"] - restarts
    if restarted != 1:
        raise CheckFailed(f"scheduler restarted {restarted} times after one kill")
    healthy = _wait_for(lambda: _health(cluster, scheduler) == "healthy", 60)
    return (
        f"kill -9 of its PID 1: {streams}; docker restarted it; a new request succeeded "
        f"{recovered - killed_at:.1f} s after the kill ({num_refused} refused before), "
        f"docker's health check said healthy after {healthy - killed_at:.1f} s"
    )


def check_scheduler_docker_kill(cluster: Cluster) -> str:
    """`docker kill`: clients get an error; Docker disables the restart policy of a container
    it was told to kill (documented for `docker kill`), so the check starts it again the way
    an operator does, with `docker-compose start`."""
    scheduler = cluster.container("scheduler")
    killed_at, streams = _kill_under_load(
        cluster, lambda: cluster.run(cluster.docker, "kill", scheduler)
    )
    time.sleep(5)  # long enough for a restart policy to act if it were going to
    if cluster.inspect(scheduler)["State"]["Running"]:
        policy = "restarted by its policy"
    else:
        policy = "stayed down 5 s (`docker kill` disables the restart policy)"
        cluster.compose("start", "scheduler")
    recovered, num_refused = _first_success(cluster)
    return (
        f"{streams}; {policy}; after `docker-compose start scheduler` a new request "
        f"succeeded {recovered - killed_at:.1f} s after the kill ({num_refused} refused before)"
    )


def check_others_kept_running(cluster: Cluster) -> str:
    for service in ("detokenizer", "frontend", "gateway"):
        state = cluster.inspect(cluster.container(service))
        if state["RestartCount"] or not state["State"]["Running"]:
            raise CheckFailed(f"{service}: restarted {state['RestartCount']} times")
    return "detokenizer, frontend and gateway rode out both scheduler kills without a restart"


def _judge_killed_streams(outcomes: list[StreamOutcome], killed_at: float) -> None:
    for i, outcome in enumerate(outcomes):
        if outcome.ended_at == 0.0:
            raise CheckFailed(f"stream {i} still open 60 s after the scheduler was killed")
        if outcome.completed or not outcome.error:
            raise CheckFailed(f"stream {i} ended without an error ({outcome.num_chunks} chunks)")
        if outcome.ended_at < killed_at:
            raise CheckFailed(f"stream {i} failed before the kill: {outcome.error}")


def _first_success(cluster: Cluster, timeout: float = 120) -> tuple[float, int]:
    """Monotonic time the first new chat completion succeeded, and the failures before it."""
    client = cluster.openai_client(timeout=30)
    deadline, num_refused = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        try:
            client.chat.completions.create(model=cluster.model, messages=PROMPT, max_tokens=4)
            return time.monotonic(), num_refused
        except openai.OpenAIError:
            num_refused += 1
            time.sleep(0.5)
    raise CheckFailed(f"no request succeeded within {timeout:.0f} s of the restart")


def check_stop(cluster: Cluster) -> str:
    """`docker-compose stop` sends SIGTERM: every service drains and exits 0 in its grace."""
    start = time.monotonic()
    cluster.compose("stop", timeout=300)
    seconds = time.monotonic() - start
    codes = {s: cluster.inspect(cluster.container(s))["State"]["ExitCode"] for s in SERVICES}
    if any(codes.values()):
        raise CheckFailed(f"exit codes after SIGTERM: {codes}")
    return f"all four exited 0 on SIGTERM; `docker-compose stop` took {seconds:.1f} s"


def check_down(cluster: Cluster) -> str:
    cluster.compose("down", "--volumes", "--timeout", "45", timeout=300)
    label = f"label=com.docker.compose.project={cluster.project}"
    left = {
        kind: cluster.run(cluster.docker, kind, "ls", "--quiet", "--filter", label).split()
        for kind in ("container", "network", "volume")
    }
    left["container"] += cluster.run(
        cluster.docker, "ps", "--all", "--quiet", "--filter", label
    ).split()
    if any(left.values()):
        raise CheckFailed(f"left behind: {left}")
    return "no container, network or volume of the project is left"


# ---------------------------------------------------------------------------


@dataclass
class Report:
    rows: list[tuple[str, bool, str, float]] = field(default_factory=list)

    def run(self, name: str, check: Callable[[], str]) -> bool:
        start = time.monotonic()
        try:
            detail, ok = check(), True
        except CheckFailed as exc:
            detail, ok = str(exc), False
        except Exception as exc:  # noqa: BLE001 - any surprise is this check's failure
            detail, ok = f"{type(exc).__name__}: {exc}", False
        self.rows.append((name, ok, detail, time.monotonic() - start))
        print(f"[check] {'PASS' if ok else 'FAIL'} {name}: {detail}", file=sys.stderr, flush=True)
        return ok

    def print(self, header: str) -> None:
        print(f"\n{header}")
        for name, ok, detail, seconds in self.rows:
            print(f"  {'PASS' if ok else 'FAIL'}  {name:<16} {detail}  [{seconds:.1f} s]")
        num_failed = sum(not ok for _, ok, _, _ in self.rows)
        print(f"{len(self.rows) - num_failed} passed, {num_failed} failed")

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _, _ in self.rows)


def machine_line(cluster: Cluster) -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().split("\n")
         if line.startswith("model name")), platform.machine(),
    )  # fmt: skip
    engine = cluster.run(cluster.docker, "version", "--format", "{{.Server.Version}}").strip()
    compose = cluster.run("docker-compose", "version", "--short").strip()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores (load average {load}); "
        f"dockerd {engine}, docker-compose {compose}"
    )


def dump_logs(cluster: Cluster) -> None:
    try:
        print(cluster.compose("logs", "--no-color", "--tail", "30"), file=sys.stderr)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        print(f"(no compose logs: {exc})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--project", default="tokenline-ct")
    p.add_argument("--image", default="tokenline:latest")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--up-started-at", type=float, default=time.time(), help="epoch seconds")
    p.add_argument("--build-seconds", type=int, default=-1)
    args = p.parse_args(argv)
    cluster = Cluster(args.project, args.image, args.http_port, args.grpc_port)
    report = Report()
    report.run("image", lambda: check_image(cluster, args.build_seconds))
    if report.run("start-up", lambda: check_startup(cluster, args.up_started_at)):
        report.run("containers", lambda: check_containers(cluster))
        report.run("kernels", lambda: check_kernels(cluster))
        report.run("openai chat", lambda: check_openai_chat(cluster))
        report.run("structured out", lambda: check_structured_output(cluster))
        report.run("grpc frontend", lambda: check_grpc_frontend(cluster))
        report.run("metrics", lambda: check_metrics(cluster))
        report.run("scheduler crash", lambda: check_scheduler_crash(cluster))
        report.run("docker kill", lambda: check_scheduler_docker_kill(cluster))
        report.run("others kept up", lambda: check_others_kept_running(cluster))
        report.run("SIGTERM stop", lambda: check_stop(cluster))
    if not report.ok:
        dump_logs(cluster)
    report.run("down -v", lambda: check_down(cluster))
    report.print(f"tokenline containers-test: {machine_line(cluster)}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
