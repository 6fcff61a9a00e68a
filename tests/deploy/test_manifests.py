"""Deployment files checked offline: schemas, linters, and the flags they pass.

These are the checks a CI image would do before `docker compose up` or
`kubectl apply`: compose against the compose spec, rendered kustomizations
strictly against the Kubernetes schema, the Dockerfile through hadolint, and
every command line they contain through the service's real argument parser.
The image and the compose cluster run for real in `make containers-test`
(deploy/containers-test.sh, root, opt-in); here only its script is checked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gateway.config import config_from_args
from services import healthcheck, launch
from services.common import default_model
from services.common.envs import ENV_VARS
from services.detokenizer.__main__ import parse_args as detokenizer_args
from services.frontend.__main__ import parse_args as frontend_args
from services.scheduler.__main__ import parse_args as scheduler_args

pytestmark = pytest.mark.tooling

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
CONTAINERS_TEST = ROOT / "deploy" / "containers-test.sh"
COMPOSE_TLS = ROOT / "deploy" / "compose.tls.yml"
KUSTOMIZATIONS = ["base", "overlays/cpu", "overlays/gpu", "overlays/tls"]

PARSERS: dict[str, Callable[[list[str]], object]] = {
    "gateway": config_from_args,
    "frontend": frontend_args,
    "scheduler": scheduler_args,
    "detokenizer": detokenizer_args,
    "build-model": lambda argv: default_model.create_parser().parse_args(argv),
    "healthcheck": lambda argv: healthcheck.create_parser().parse_args(argv),
    "launch": lambda argv: launch.create_parser().parse_args(argv),
}


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)


def render(kustomization: str) -> str:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with built-in kustomize) is not installed")
    result = run(["kubectl", "kustomize", str(ROOT / "deploy" / "k8s" / kustomization)])
    assert result.returncode == 0, result.stderr
    return result.stdout


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with the defaults, as `docker compose config` would."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


@pytest.mark.parametrize("compose_file", [COMPOSE, COMPOSE_TLS], ids=lambda p: p.name)
def test_compose_validates_against_compose_spec(compose_file: Path) -> None:
    result = run(
        [
            str(BIN / "check-jsonschema"),
            "--builtin-schema",
            "vendor.compose-spec",
            str(compose_file),
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kustomization_validates_strictly(kustomization: str, tmp_path: Path) -> None:
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(render(kustomization))
    result = run([str(BIN / "kubernetes-validate"), "--strict", str(rendered)])
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered.read_text())}
    assert {
        "Deployment",
        "StatefulSet",
        "Service",
        "ConfigMap",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
    } <= kinds


def test_dockerfile_passes_hadolint() -> None:
    result = run([str(BIN / "hadolint"), str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def compose_commands() -> list[list[str]]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    commands = []
    for spec in services.values():
        command = spec.get("command")
        if command and command[0] in PARSERS:
            commands.append([interpolate(str(c)) for c in command])
        test = spec.get("healthcheck", {}).get("test", [])
        if test[:2] == ["CMD", "tokenline"]:
            commands.append(test[2:])
    return commands


def k8s_commands() -> list[list[str]]:
    commands = []
    for kustomization in KUSTOMIZATIONS:
        for doc in yaml.safe_load_all(render(kustomization)):
            pod = doc.get("spec", {}).get("template", {}).get("spec", {})
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                commands.append(container["args"])
                commands.extend(exec_probe_commands(container))
    return commands


def exec_probe_commands(container: dict) -> list[list[str]]:
    """`tokenline ...` exec probes (the TLS overlay's health checks), without `tokenline`."""
    commands = []
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = container.get(probe, {}).get("exec", {}).get("command", [])
        if command[:1] == ["tokenline"]:
            commands.append(command[1:])
    return commands


def dockerfile_commands() -> list[list[str]]:
    text = DOCKERFILE.read_text()
    entrypoint = yaml.safe_load(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    cmd = yaml.safe_load(re.search(r"^CMD (.+)$", text, re.M).group(1))
    assert entrypoint == ["tokenline"]
    return [cmd]


@pytest.mark.parametrize("source", [compose_commands, k8s_commands, dockerfile_commands])
def test_every_command_line_is_accepted_by_the_real_parser(source) -> None:
    commands = source()
    assert commands, f"{source.__name__} found no command lines"
    for command in commands:
        name, argv = command[0], command[1:]
        assert name in PARSERS, f"unknown tokenline command {name!r}"
        try:
            PARSERS[name](argv)
        except SystemExit as exc:
            pytest.fail(f"`tokenline {' '.join(command)}` rejected by the parser ({exc})")


def test_k8s_probes_are_grpc_on_numeric_ports_with_distinct_readiness() -> None:
    for doc in yaml.safe_load_all(render("base")):
        for container in (
            doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        ):
            if "grpc" not in container.get("readinessProbe", {}):
                continue
            live, ready = container["livenessProbe"]["grpc"], container["readinessProbe"]["grpc"]
            assert isinstance(live["port"], int) and isinstance(ready["port"], int)
            assert live.get("service", "") == ""
            assert ready["service"] == "tokenline.readiness"


def test_gpu_overlay_gives_each_scheduler_a_gpu_and_cpu_overlay_none() -> None:
    def scheduler(kustomization: str) -> dict:
        docs = yaml.safe_load_all(render(kustomization))
        (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
        return sts["spec"]["template"]["spec"]["containers"][0]

    assert scheduler("overlays/gpu")["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in str(scheduler("overlays/cpu")["resources"])


def test_prometheus_scrapes_each_compose_service_on_its_metrics_port() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    expected = {"gateway:8000"}
    for name in ("frontend", "scheduler", "detokenizer"):
        command = services[name]["command"]
        expected.add(f"{name}:{command[command.index('--metrics-port') + 1]}")
    assert targets == expected


def test_k8s_scrape_annotations_name_the_port_each_pod_serves_metrics_on() -> None:
    annotated = set()
    for doc in yaml.safe_load_all(render("base")):
        template = doc.get("spec", {}).get("template")
        if not template:
            continue
        notes = template["metadata"].get("annotations", {})
        (container,) = template["spec"]["containers"]
        args, ports = container["args"], {p["containerPort"] for p in container["ports"]}
        assert notes.get("prometheus.io/scrape") == "true", doc["metadata"]["name"]
        port = int(notes["prometheus.io/port"])
        assert port in ports
        if "--metrics-port" in args:
            assert port == int(args[args.index("--metrics-port") + 1])
        annotated.add(args[0])
    assert annotated == {"gateway", "frontend", "scheduler", "detokenizer"}


def test_compose_tls_override_gives_every_grpc_hop_the_same_declared_tls_settings() -> None:
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    override = yaml.safe_load(COMPOSE_TLS.read_text())["services"]
    assert set(override) == {"gateway", "frontend", "scheduler", "detokenizer"} <= set(base)
    for spec in override.values():
        env = spec["environment"]
        assert set(env) <= set(ENV_VARS)
        assert {"TOKENLINE_TLS_CERT", "TOKENLINE_TLS_KEY", "TOKENLINE_TLS_CA"} <= set(env)
        (mount,) = spec["volumes"]
        assert mount.endswith(":/certs:ro")
        assert all(env[k].startswith("/certs/") for k in env if k != "TOKENLINE_TLS_CLIENT_AUTH")


def test_k8s_tls_overlay_mounts_the_secret_and_probes_through_tls_healthchecks() -> None:
    docs = list(yaml.safe_load_all(render("overlays/tls")))
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config["data"]["TOKENLINE_TLS_CLIENT_AUTH"] == "require"
    probed = set()
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if not pod:
            continue
        (container,) = pod["containers"]
        secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        assert secrets == ["tokenline-tls"], doc["metadata"]["name"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert config["data"]["TOKENLINE_TLS_CA"].rsplit("/", 1)[0] in mounts
        if container["args"][0] == "gateway":
            continue
        port = container["ports"][0]["containerPort"]
        for probe, service in [("livenessProbe", [""]), ("readinessProbe", [])]:
            assert "grpc" not in container[probe]
            command = container[probe]["exec"]["command"]
            assert command[:4] == ["tokenline", "healthcheck", "--addr", f"127.0.0.1:{port}"]
            assert command[5:] == service
        probed.add(container["args"][0])
    assert probed == {"frontend", "scheduler", "detokenizer"}


def test_compose_publishes_ports_on_loopback_by_default() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    published = [interpolate(p) for spec in services.values() for p in spec.get("ports", [])]
    assert published and all(p.startswith("127.0.0.1:") for p in published), published


def test_containers_test_script_parses_and_passes_build_args_the_dockerfile_declares() -> None:
    result = run(["bash", "-n", str(CONTAINERS_TEST)])
    assert result.returncode == 0, result.stderr
    passed = set(re.findall(r'--build-arg "(\w+)=', CONTAINERS_TEST.read_text()))
    declared = set(re.findall(r"^ARG (\w+)", DOCKERFILE.read_text(), re.M))
    assert passed and passed <= declared, passed - declared


def test_containers_check_module_loads() -> None:
    result = run([sys.executable, str(ROOT / "deploy" / "containers_check.py"), "--help"])
    assert result.returncode == 0, result.stderr
