"""The Grafana dashboard and its provisioning, checked offline against the real metrics.

Every metric name a panel queries must be one the services actually export. The
set of exported names is not copied by hand: tests/metric_names.py builds each
service's metrics class into a fresh registry and reads the names back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import promql_parser
import pytest
import yaml

from tests.metric_names import (
    DASHBOARD,
    STRING,
    dashboard_metric_names,
    exported_series,
    exprs,
    load_dashboard,
    query_panels,
)

pytestmark = pytest.mark.tooling

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "tokenline.yml"
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"

DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}

# Metric name prefix -> the service that owns those names.
PREFIXES = {
    "tokenline:": "scheduler",
    "tokenline_grpc_": "every gRPC service",
    "tokenline_gateway_": "gateway",
    "tokenline_frontend_": "frontend",
    "tokenline_detokenizer_": "detokenizer",
}


def all_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def owner(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return prefix
    raise AssertionError(f"{name}: no service exports metrics with this prefix")


def template_var(dashboard: dict, name: str) -> dict:
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == name]
    return var


# ---------------------------------------------------------------------------
# Dashboard structure


def test_dashboard_identity_and_variables() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "tokenline"
    assert dashboard["title"] == "tokenline"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert "id" not in dashboard or dashboard["id"] is None  # provisioned, not exported

    datasource = template_var(dashboard, "datasource")
    assert datasource["type"] == "datasource"
    assert datasource["query"] == "prometheus"

    model = template_var(dashboard, "model_name")
    assert model["type"] == "query"
    assert model["datasource"] == DATASOURCE_REF
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query == "label_values(tokenline:num_requests_running, model_name)"


def test_panel_ids_are_unique_and_every_panel_queries_through_the_variable() -> None:
    dashboard = load_dashboard()
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    panels = query_panels(dashboard)
    assert len(panels) >= 20
    for panel in panels:
        assert panel.get("datasource") == DATASOURCE_REF, panel["title"]
        assert panel["targets"], f"{panel['title']}: no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE_REF, panel["title"]
            assert target.get("expr", "").strip(), f"{panel['title']}: empty expr"


def test_grid_positions_fit_and_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels(load_dashboard()):
        pos = panel["gridPos"]
        assert 1 <= pos["w"] <= 24 and pos["h"] >= 1, panel["title"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                other = cells.setdefault((x, y), panel["title"])
                assert other == panel["title"], f"{panel['title']!r} overlaps {other!r}"


def test_rows_cover_every_area() -> None:
    rows = [p["title"] for p in load_dashboard()["panels"] if p["type"] == "row"]
    for area in ("Overview", "Latency", "Stage", "Cache", "Tokenizer", "gRPC", "Gateway"):
        assert any(area in row for row in rows), f"no {area} row in {rows}"


# ---------------------------------------------------------------------------
# PromQL


@pytest.mark.parametrize("expr", exprs())
def test_expr_is_valid_promql(expr: str) -> None:
    # Grafana substitutes its variables before Prometheus sees the query.
    promql_parser.parse(expr.replace("$__rate_interval", "1m"))
    code = STRING.sub('""', expr)
    # Every range is Grafana's rate interval, and every rate has a range.
    assert set(re.findall(r"\[([^\]]*)\]", code)) <= {"$__rate_interval"}
    for func in re.findall(r"\b(rate|increase|irate)\s*\(", code):
        assert "[$__rate_interval]" in code, f"{func} without a range"
    # histogram_quantile needs buckets aggregated by le.
    if "histogram_quantile" in code:
        assert "_bucket" in code
        for group in re.findall(r"\bby\s*\(([^)]*)\)", code):
            assert "le" in [g.strip() for g in group.split(",")], f"by ({group}) lacks le"
    # Only variables the dashboard defines (or Grafana's own) are used.
    for var in re.findall(r"\$\{?(\w+)", code):
        assert var in {"model_name", "datasource", "__rate_interval"}, var


def test_scheduler_series_are_filtered_by_model_name() -> None:
    for expr in exprs():
        for name, selector in re.findall(r"(?<![\w:])(tokenline:[\w:]+)(\{[^}]*\})?", expr):
            assert 'model_name=~"$model_name"' in selector, f"{name} in {expr}"


def test_every_dashboard_metric_is_exported() -> None:
    used = dashboard_metric_names()
    missing = used - exported_series()
    assert not missing, f"queried but not exported: {sorted(missing)}"
    # Guard the extraction itself: it must see names from every service.
    assert {owner(n) for n in used} == set(PREFIXES)


def test_exported_series_include_derived_names_only() -> None:
    names = exported_series()
    assert {
        "tokenline_gateway_requests_total",
        "tokenline_gateway_request_duration_seconds_bucket",
        "tokenline_gateway_request_duration_seconds_count",
        "tokenline_gateway_requests_in_flight",
    } <= names
    # Bare counter/histogram family names are not series Prometheus would store.
    assert not {"tokenline_gateway_requests", "tokenline_gateway_request_duration_seconds"} & names


# ---------------------------------------------------------------------------
# Provisioning and compose


def compose_grafana() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]


def mounts() -> dict[str, Path]:
    """Container path -> host path of the grafana service's bind mounts."""
    result = {}
    for volume in compose_grafana()["volumes"]:
        host, container, *_ = volume.split(":")
        result[container] = (ROOT / host).resolve()
    return result


def test_provisioned_datasource_is_the_dashboards_default() -> None:
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    default = template_var(load_dashboard(), "datasource")
    assert source["type"] == default["query"] == "prometheus"
    assert source["uid"] == default["current"]["value"]
    assert source["isDefault"] is True
    assert source["url"] == "http://prometheus:9090"
    scrape = yaml.safe_load(PROMETHEUS.read_text())["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape


def test_compose_grafana_mounts_existing_provisioning_and_dashboards() -> None:
    service = compose_grafana()
    image, _, tag = service["image"].partition(":")
    assert image == "grafana/grafana" and re.fullmatch(r"\d+\.\d+\.\d+", tag), service["image"]
    assert service["profiles"] == ["monitoring"]
    assert "prometheus" in service["depends_on"]
    assert all(v.endswith(":ro") for v in service["volumes"])

    paths = mounts()
    assert paths["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    assert (paths["/etc/grafana/provisioning"] / "datasources" / DATASOURCES.name).is_file()
    assert (paths["/etc/grafana/provisioning"] / "dashboards" / PROVIDERS.name).is_file()

    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    dashboards = paths[provider["options"]["path"]]
    assert dashboards == DASHBOARD.parent and (dashboards / DASHBOARD.name).is_file()

    home = service.get("environment", {}).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert paths[str(Path(home).parent)] / Path(home).name == DASHBOARD
