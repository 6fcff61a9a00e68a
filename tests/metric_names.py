"""Metric names read two ways: what the services' metric classes register, and what the
Grafana dashboard queries. Shared by the dashboard, docs/observability.md and live-stack
tests, so none of them keeps a hand-copied list."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics
from services.common.rpc.metrics import RpcMetrics
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.metrics import DetokenizerMetrics
from services.detokenizer.server import DetokenizerServicer
from services.frontend.metrics import FrontendMetrics
from services.scheduler.transport.metrics import SchedulerMetrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "tokenline.json"

# Series names prometheus_client derives from a family's name, by family type. A bare
# counter or histogram family name is no series, so a query for it would find nothing.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def service_registries() -> dict[str, CollectorRegistry]:
    """Each service's metrics, built into a fresh registry (gRPC ones are shared by all)."""
    registries = {name: CollectorRegistry() for name in ("frontend", "scheduler", "detokenizer")}
    FrontendMetrics(registries["frontend"])
    SchedulerMetrics("m", registries["scheduler"])
    manager = DetokenizerManager(decoder=None)  # type: ignore[arg-type]  # gauges only
    DetokenizerMetrics(registries["detokenizer"]).track(manager, DetokenizerServicer(manager))
    registries["grpc"] = CollectorRegistry()
    RpcMetrics(registries["grpc"])
    registries["gateway"] = GatewayMetrics().registry
    return registries


def family_names() -> dict[str, str]:
    """Name as documented (counters with ``_total``) -> Prometheus type, for every family."""
    names = {}
    for registry in service_registries().values():
        for family in registry.collect():
            suffix = "_total" if family.type == "counter" else ""
            names[family.name + suffix] = family.type
    return names


def exported_series() -> set[str]:
    """Every series name a scrape can show: the ones each family implies by its type."""
    names: set[str] = set()
    for registry in service_registries().values():
        for family in registry.collect():
            names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def query_panels(dashboard: dict) -> list[dict]:
    """Every non-row panel, including those nested in collapsed rows."""
    panels = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            panels.extend(panel.get("panels", []))
        else:
            panels.append(panel)
    return panels


def exprs() -> list[str]:
    return [t["expr"] for p in query_panels(load_dashboard()) for t in p["targets"]]


STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
# A name at a word start: `tokenline` inside a label value or another name is not one.
_METRIC = re.compile(r"(?<![\w:])tokenline[\w:]*")


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(STRING.sub('""', expr)))


def dashboard_metric_names() -> set[str]:
    return set().union(*(metric_names(e) for e in exprs()))
