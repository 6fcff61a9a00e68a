"""Each service on its own host: one Linux network namespace per service.

The namespaces hang off a bridge in a switch namespace of their own, so the
test touches nothing outside what it creates. Skipped (with the reason) where
namespaces cannot be made, e.g. without CAP_NET_ADMIN.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.live

SUBNET = "10.77.{}.{}"
HOSTS = {"detokenizer": 2, "scheduler": 3, "frontend": 4, "gateway": 5, "client": 6}
PORTS = {"detokenizer": 50053, "scheduler": 50052, "frontend": 50051, "gateway": 8000}


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Hosts:
    """Namespaces named tl-<tag>-<host>, each with one veth on the switch's bridge."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    octet: int = field(default_factory=lambda: os.getpid() % 200 + 20)
    made: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"tl-{self.tag}-{host[:5]}"

    def addr(self, host: str) -> str:
        return SUBNET.format(self.octet, HOSTS[host])

    def create(self) -> None:
        switch = self.ns("switch")
        ip("netns", "add", switch)
        self.made.append(switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for host in HOSTS:
            ns, inner, outer = self.ns(host), f"v{self.tag}{host[:3]}", f"p{self.tag}{host[:3]}"
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "netns", switch)
            ip("-n", switch, "link", "set", outer, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def delete(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def run_in(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], **kwargs)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    hosts = Hosts()
    try:
        hosts.create()
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        hosts.delete()
        detail = getattr(exc, "stderr", b"") or str(exc).encode()
        pytest.skip(f"cannot create network namespaces here: {detail.decode().strip()}")
    yield hosts
    hosts.delete()


def service_commands(hosts: Hosts, model: str) -> dict[str, list[str]]:
    py = sys.executable

    def at(host: str) -> str:
        return f"{hosts.addr(host)}:{PORTS[host]}"

    def bind(host: str) -> list[str]:
        return ["--host", hosts.addr(host), "--port", str(PORTS[host])]

    return {
        "detokenizer": [py, "-m", "services.detokenizer", "--model", model, *bind("detokenizer")],
        "scheduler": [
            py,
            "-m",
            "services.scheduler",
            "--model",
            model,
            *bind("scheduler"),
            "--detokenizer-addr",
            at("detokenizer"),
            "--num-threads",
            "1",
        ],
        "frontend": [
            py,
            "-m",
            "services.frontend",
            "--model",
            model,
            *bind("frontend"),
            "--scheduler-addrs",
            at("scheduler"),
            "--detokenizer-addr",
            at("detokenizer"),
        ],
        "gateway": [py, "-m", "gateway", *bind("gateway"), "--frontend-addr", at("frontend")],
    }


CLIENT = """
import json, sys, time, openai, urllib.request

base = sys.argv[1]
deadline = time.time() + 180
while True:
    try:
        urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=2)
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.5)
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8,
    messages=[{"role": "user", "content": "hi"}], temperature=0)
print(json.dumps({"finish": r.choices[0].finish_reason, "tokens": r.usage.completion_tokens}))
"""


def test_chat_completion_across_four_hosts(
    hosts: Hosts, default_model_dir: Path, tmp_path: Path
) -> None:
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, argv in service_commands(hosts, str(default_model_dir)).items():
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
            procs[name] = hosts.run_in(name, argv, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://{hosts.addr('gateway')}:{PORTS['gateway']}/v1"
        client = hosts.run_in(
            "client",
            [sys.executable, "-c", CLIENT, base],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = client.communicate(timeout=300)
        assert client.returncode == 0, err.decode()[-3000:] + _logs(tmp_path)
        result = json.loads(out.decode().strip().splitlines()[-1])
        assert result["tokens"] >= 1 and result["finish"] in ("stop", "length")
    finally:
        for proc in procs.values():
            proc.terminate()
        deadline = time.monotonic() + 20
        for proc in procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _logs(log_dir: Path) -> str:
    return "".join(
        f"\n---- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
        for p in sorted(log_dir.glob("*.log"))
    )
