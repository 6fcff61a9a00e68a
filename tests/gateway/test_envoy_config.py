"""deploy/envoy/envoy.yaml: valid against Envoy's own API protos, and wired to our services.

xds-protos carries Envoy's v3 API as Python protobuf, so parsing the YAML into a
`Bootstrap` rejects any field Envoy does not know, in the typed filter configs too.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.http.grpc_json_transcoder.v3 import transcoder_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401 - registers the type
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import json_format
from test_proto_http_rules import EXPECTED_RULES, SERVICE

from gateway.config import GatewayConfig
from services.common.gen_protos import DESCRIPTOR_SET, ROOT

pytestmark = pytest.mark.tooling

ENVOY_YAML = ROOT / "deploy" / "envoy" / "envoy.yaml"
TRANSCODER = "envoy.filters.http.grpc_json_transcoder"
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


@pytest.fixture(autouse=True)
def fake() -> None:
    """No frontend here: override the gateway suite's autouse fake-frontend reset."""


@pytest.fixture(scope="module")
def bootstrap() -> bootstrap_pb2.Bootstrap:
    raw: dict[str, Any] = yaml.safe_load(ENVOY_YAML.read_text())
    return json_format.ParseDict(raw, bootstrap_pb2.Bootstrap())


@pytest.fixture(scope="module")
def hcm(bootstrap: bootstrap_pb2.Bootstrap) -> hcm_pb2.HttpConnectionManager:
    (listener,) = bootstrap.static_resources.listeners
    (chain,) = listener.filter_chains
    (network_filter,) = chain.filters
    out = hcm_pb2.HttpConnectionManager()
    assert network_filter.typed_config.Unpack(out)
    return out


@pytest.fixture(scope="module")
def transcoder(hcm: hcm_pb2.HttpConnectionManager) -> transcoder_pb2.GrpcJsonTranscoder:
    (entry,) = [f for f in hcm.http_filters if f.name == TRANSCODER]
    out = transcoder_pb2.GrpcJsonTranscoder()
    assert entry.typed_config.Unpack(out)
    return out


def _clusters(bootstrap: bootstrap_pb2.Bootstrap) -> dict[str, cluster_pb2.Cluster]:
    return {c.name: c for c in bootstrap.static_resources.clusters}


def _route_for(hcm: hcm_pb2.HttpConnectionManager, path: str) -> str | None:
    """The cluster Envoy's first-match routing picks for `path`."""
    for route in hcm.route_config.virtual_hosts[0].routes:
        match = route.match
        if (match.HasField("prefix") and path.startswith(match.prefix)) or match.path == path:
            return route.route.cluster
    return None


def test_transcoder_serves_the_frontend_service(
    transcoder: transcoder_pb2.GrpcJsonTranscoder,
) -> None:
    assert list(transcoder.services) == [SERVICE]
    assert transcoder.print_options.preserve_proto_field_names
    assert transcoder.print_options.stream_sse_style_delimited
    assert transcoder.convert_grpc_status


def test_transcoder_loads_the_descriptor_make_descriptor_writes(
    transcoder: transcoder_pb2.GrpcJsonTranscoder,
) -> None:
    # Compose mounts deploy/envoy (where `make descriptor` writes) at envoy.yaml's folder.
    loaded = PurePosixPath(transcoder.proto_descriptor)
    assert DESCRIPTOR_SET.parent == ENVOY_YAML.parent
    assert loaded.name == DESCRIPTOR_SET.name
    compose = ROOT / "docker-compose.yml"
    if compose.exists():
        envoy = yaml.safe_load(compose.read_text())["services"]["envoy"]
        assert f"./deploy/envoy:{loaded.parent}:ro" in envoy["volumes"]
        assert f"{loaded.parent}/{ENVOY_YAML.name}" in envoy["command"]


def test_router_is_the_last_filter(hcm: hcm_pb2.HttpConnectionManager) -> None:
    names = [f.name for f in hcm.http_filters]
    assert names == [TRANSCODER, "envoy.filters.http.router"]


def test_native_api_goes_to_the_frontend_and_openai_to_the_gateway(
    hcm: hcm_pb2.HttpConnectionManager,
) -> None:
    # The transcoder rewrites a JSON request to its gRPC path before routing.
    for method in EXPECTED_RULES:
        assert _route_for(hcm, f"/{SERVICE}/{method}") == "frontend"
    for _, path, _ in EXPECTED_RULES.values():
        assert _route_for(hcm, path) != "gateway"  # the transcoder, not the gateway
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health"):
        assert _route_for(hcm, path) == "gateway"


def test_authorization_reaches_the_frontend_unchanged(
    hcm: hcm_pb2.HttpConnectionManager, transcoder: transcoder_pb2.GrpcJsonTranscoder
) -> None:
    """Both doors apply one rule: a transcoded call's `Authorization` header arrives as
    the gRPC `authorization` metadata the frontend's interceptor checks. Envoy forwards
    request headers unless told otherwise, so nothing here may remove or consume it."""
    config = hcm.route_config
    vhost = config.virtual_hosts[0]
    removed = [*config.request_headers_to_remove, *vhost.request_headers_to_remove]
    for route in vhost.routes:
        removed += route.request_headers_to_remove
    assert "authorization" not in [h.lower() for h in removed]
    assert not hcm.strip_matching_host_port and not config.internal_only_headers
    # No auth filter in Envoy itself: the frontend is the one place keys are checked.
    assert [f.name for f in hcm.http_filters] == [TRANSCODER, "envoy.filters.http.router"]
    assert not transcoder.HasField("request_validation_options")


def test_streaming_routes_have_no_timeout(hcm: hcm_pb2.HttpConnectionManager) -> None:
    for route in hcm.route_config.virtual_hosts[0].routes:
        if route.match.prefix:
            assert route.route.HasField("timeout") and route.route.timeout.ToSeconds() == 0


def test_clusters_match_the_service_defaults(
    bootstrap: bootstrap_pb2.Bootstrap, hcm: hcm_pb2.HttpConnectionManager
) -> None:
    clusters = _clusters(bootstrap)
    routed = {r.route.cluster for vh in hcm.route_config.virtual_hosts for r in vh.routes}
    assert routed == set(clusters) == {"frontend", "gateway"}
    defaults = GatewayConfig()
    assert _port(clusters["frontend"]) == int(defaults.frontend_addr.rsplit(":", 1)[1])
    assert _port(clusters["gateway"]) == defaults.port


def test_frontend_cluster_speaks_http2(bootstrap: bootstrap_pb2.Bootstrap) -> None:
    clusters = _clusters(bootstrap)
    options = http_protocol_options_pb2.HttpProtocolOptions()
    assert clusters["frontend"].typed_extension_protocol_options[_HTTP_OPTIONS].Unpack(options)
    assert options.explicit_http_config.HasField("http2_protocol_options")
    assert _HTTP_OPTIONS not in clusters["gateway"].typed_extension_protocol_options


def _port(cluster: cluster_pb2.Cluster) -> int:
    (endpoints,) = cluster.load_assignment.endpoints
    (lb_endpoint,) = endpoints.lb_endpoints
    return lb_endpoint.endpoint.address.socket_address.port_value


def test_unknown_field_is_rejected() -> None:
    """The schema check above is real: a misspelt transcoder option fails to parse."""
    text = ENVOY_YAML.read_text().replace("stream_sse_style_delimited", "stream_sse_delimited")
    with pytest.raises(json_format.ParseError, match="stream_sse_delimited"):
        json_format.ParseDict(yaml.safe_load(text), bootstrap_pb2.Bootstrap())
