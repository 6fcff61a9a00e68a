"""Keys and the cluster token reach the right containers, offline: in compose and in the
rendered Kubernetes base, every tokenline service takes the cluster token, and both
public doors (gateway and frontend) take the API key, so neither is left open."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.deploy.test_manifests import COMPOSE, render

pytestmark = pytest.mark.tooling

SERVICES = {"gateway", "frontend", "scheduler", "detokenizer"}
DOORS = {"gateway", "frontend"}


def test_compose_gives_the_token_to_all_and_the_key_to_both_doors() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    env = {name: services[name].get("environment", {}) for name in SERVICES}
    assert {n for n, e in env.items() if "TOKENLINE_CLUSTER_TOKEN" in e} == SERVICES
    assert {n for n, e in env.items() if "TOKENLINE_API_KEY" in e} == DOORS


def _secrets(doc: dict[str, Any]) -> set[str]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return {s["secretRef"]["name"] for s in container.get("envFrom", []) if "secretRef" in s}


def test_k8s_gives_the_token_to_all_and_the_key_to_both_doors() -> None:
    docs = [
        d for d in yaml.safe_load_all(render("base")) if d["kind"] in {"Deployment", "StatefulSet"}
    ]
    secrets = {d["metadata"]["name"]: _secrets(d) for d in docs}
    assert set(secrets) == SERVICES
    assert {n for n, s in secrets.items() if "tokenline-cluster-token" in s} == SERVICES
    assert {n for n, s in secrets.items() if "tokenline-api-key" in s} == DOORS
