"""deploy/k8s's NetworkPolicies, read offline from the rendered base: who may reach which
named port of each service, and that every port they name is one the pod serves."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.deploy.test_manifests import render

pytestmark = pytest.mark.tooling

ANYONE = "*"
# (target, port name) -> the pods (by app.kubernetes.io/name) that may reach it.
EXPECTED = {
    ("scheduler", "grpc"): {"frontend"},
    ("scheduler", "metrics"): {"prometheus"},
    ("detokenizer", "grpc"): {"scheduler", "frontend"},
    ("detokenizer", "metrics"): {"prometheus"},
    ("frontend", "grpc"): {"gateway", "envoy"},
    ("frontend", "metrics"): {"prometheus"},
    ("gateway", "http"): {ANYONE},
}


def _name(selector: dict[str, Any]) -> str:
    return selector["matchLabels"]["app.kubernetes.io/name"]


def _sources(rule: dict[str, Any]) -> set[str]:
    if "from" not in rule:
        return {ANYONE}
    return {_name(peer["podSelector"]) for peer in rule["from"]}


def _allowed(docs: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    allowed: dict[tuple[str, str], set[str]] = {}
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        target = _name(spec["podSelector"])
        for rule in spec["ingress"]:
            for port in rule["ports"]:
                allowed.setdefault((target, port["port"]), set()).update(_sources(rule))
    return allowed


def _pod_ports(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    ports = {}
    for doc in docs:
        template = doc.get("spec", {}).get("template")
        if doc["kind"] in {"Deployment", "StatefulSet"} and template:
            (container,) = template["spec"]["containers"]
            ports[_name(doc["spec"]["selector"])] = {p["name"] for p in container["ports"]}
    return ports


def test_each_port_is_open_to_exactly_its_callers() -> None:
    docs = list(yaml.safe_load_all(render("base")))
    assert _allowed(docs) == EXPECTED


def test_every_pod_is_covered_and_every_named_port_exists() -> None:
    docs = list(yaml.safe_load_all(render("base")))
    ports = _pod_ports(docs)
    assert set(ports) == {target for target, _ in EXPECTED}
    for target, port in _allowed(docs):
        assert port in ports[target], (target, port)
    # Every port a pod serves is governed: none is left open by omission.
    assert {(t, p) for t, names in ports.items() for p in names} == set(EXPECTED)
