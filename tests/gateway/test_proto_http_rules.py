"""The Envoy path's proto side: `make descriptor` output, HTTP rules, JSON-safe number types."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from google.api import annotations_pb2, http_pb2
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from tokenline.v1 import frontend_pb2

from services.common.gen_protos import DESCRIPTOR_SET, ROOT, build_descriptor_set

SERVICE = "tokenline.v1.FrontendService"
# The native API's JSON routes (frontend.proto). Envoy serves them; the gateway owns /v1/*.
EXPECTED_RULES: dict[str, tuple[str, str, str]] = {
    "ChatCompletion": ("post", "/tokenline.v1/chat/completions", "*"),
    "ChatCompletionStream": ("post", "/tokenline.v1/chat/completions:stream", "*"),
    "Completion": ("post", "/tokenline.v1/completions", "*"),
    "CompletionStream": ("post", "/tokenline.v1/completions:stream", "*"),
    "ResponsesCreate": ("post", "/tokenline.v1/responses", "*"),
    "ResponsesCreateStream": ("post", "/tokenline.v1/responses:stream", "*"),
    "ResponsesGet": ("get", "/tokenline.v1/responses/{response_id}", ""),
    "ResponsesGetStream": ("get", "/tokenline.v1/responses/{response_id}:stream", ""),
    "ResponsesInputItems": ("get", "/tokenline.v1/responses/{response_id}/input_items", ""),
    "ResponsesDelete": ("delete", "/tokenline.v1/responses/{response_id}", ""),
    "ResponsesCancel": ("post", "/tokenline.v1/responses/{response_id}:cancel", "*"),
    "Embed": ("post", "/tokenline.v1/embeddings", "*"),
    "Generate": ("post", "/tokenline.v1/generate", "*"),
    "GenerateStream": ("post", "/tokenline.v1/generate:stream", "*"),
    "Tokenize": ("post", "/tokenline.v1/tokenize", "*"),
    "Detokenize": ("post", "/tokenline.v1/detokenize", "*"),
    "ListModels": ("get", "/tokenline.v1/models", ""),
    "OpenSession": ("post", "/tokenline.v1/open_session", "*"),
    "CloseSession": ("post", "/tokenline.v1/close_session", "*"),
    "GetModelInfo": ("get", "/tokenline.v1/model_info", ""),
    "Abort": ("post", "/tokenline.v1/abort_request", "*"),
    "FlushCache": ("post", "/tokenline.v1/flush_cache", "*"),
}
# gRPC only: an operator's view with uint64 counters (see the comment in frontend.proto).
UNANNOTATED = {"GetInfo", "GetServerInfo", "Multiplex"}
_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}
# Request fields allowed to be 64-bit: JSON clients only write them, and proto3 JSON
# parsing accepts a number or a string (frontend.proto documents it).
INT64_INPUTS = {
    "tokenline.v1.SamplingParams.seed",
    "tokenline.v1.OpenAISampling.seed",
    "tokenline.v1.ResponsesRequest.seed",
}


@pytest.fixture(autouse=True)
def fake() -> None:
    """No frontend here: override the gateway suite's autouse fake-frontend reset."""


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path_factory.mktemp("descriptor") / DESCRIPTOR_SET.name
    assert build_descriptor_set(out) == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


@pytest.fixture(scope="module")
def pool(descriptor_set: descriptor_pb2.FileDescriptorSet) -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_set.file:  # protoc writes dependencies first
        pool.Add(file)
    return pool


def _http_rule(options: descriptor_pb2.MethodOptions) -> tuple[str, str, str] | None:
    if not options.HasExtension(annotations_pb2.http):
        return None
    rule: http_pb2.HttpRule = options.Extensions[annotations_pb2.http]
    verb = rule.WhichOneof("pattern")
    return verb, getattr(rule, verb), rule.body


def _service(
    descriptor_set: descriptor_pb2.FileDescriptorSet,
) -> descriptor_pb2.ServiceDescriptorProto:
    for file in descriptor_set.file:
        for service in file.service:
            if f"{file.package}.{service.name}" == SERVICE:
                return service
    raise AssertionError(f"{SERVICE} missing from the descriptor set")


def test_descriptor_set_is_self_contained(descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    names = {f.name for f in descriptor_set.file}
    # Envoy resolves every import from the set itself: nothing may be missing.
    for file in descriptor_set.file:
        assert set(file.dependency) <= names, file.name
    assert {"google/api/annotations.proto", "google/api/http.proto"} <= names
    assert "google/protobuf/descriptor.proto" in names
    frontend = next(f for f in descriptor_set.file if f.name == "tokenline/v1/frontend.proto")
    assert frontend.source_code_info.location, "--include_source_info was not applied"


def test_every_rpc_has_its_http_rule(descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    service = _service(descriptor_set)
    rules = {m.name: _http_rule(m.options) for m in service.method}
    assert set(rules) == set(EXPECTED_RULES) | UNANNOTATED, "an RPC was added: annotate it here"
    assert {name: rules[name] for name in EXPECTED_RULES} == EXPECTED_RULES
    assert all(rules[name] is None for name in UNANNOTATED)


def test_rules_stay_out_of_the_gateway_routes() -> None:
    paths = [path for _, path, _ in EXPECTED_RULES.values()]
    routes = [(verb, path) for verb, path, _ in EXPECTED_RULES.values()]
    assert len(set(routes)) == len(routes)  # a path may take two verbs (GET, DELETE)
    for path in paths:
        assert path.startswith("/tokenline.v1/") and not path.startswith("/v1/")
        assert path not in {"/generate", "/health", "/metrics"}


def test_streaming_rpcs_are_the_stream_paths(
    descriptor_set: descriptor_pb2.FileDescriptorSet,
) -> None:
    for method in _service(descriptor_set).method:
        if method.name in UNANNOTATED:
            continue
        _, path, _ = EXPECTED_RULES[method.name]
        assert method.server_streaming == path.endswith(":stream"), method.name
        assert not method.client_streaming


def test_generated_stubs_carry_the_same_rules() -> None:
    """The Python stubs (make proto) and the descriptor set (make descriptor) agree."""
    service = frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"]
    for method in service.methods:
        options = descriptor_pb2.MethodOptions.FromString(method.GetOptions().SerializeToString())
        assert _http_rule(options) == EXPECTED_RULES.get(method.name), method.name


def _fields(message: Descriptor, seen: set[str]) -> Iterator[FieldDescriptor]:
    """Every field reachable from `message`, each message type visited once."""
    if message.full_name in seen:
        return
    seen.add(message.full_name)
    for field in message.fields:
        yield field
        if field.message_type is not None:
            yield from _fields(field.message_type, seen)


def test_json_numbers_on_the_native_path_are_not_64_bit(
    pool: descriptor_pool.DescriptorPool,
) -> None:
    """proto3 JSON prints int64 as a string: counts and stamps a client reads must be 32-bit
    or double. Inputs may be 64-bit only where listed (a JSON parser takes both forms)."""
    service = pool.FindServiceByName(SERVICE)
    outputs: set[str] = set()
    inputs: set[str] = set()
    for method in service.methods:
        if method.name in UNANNOTATED:
            continue
        outputs |= {
            f.full_name for f in _fields(method.output_type, set()) if f.type in _INT64_TYPES
        }
        inputs |= {f.full_name for f in _fields(method.input_type, set()) if f.type in _INT64_TYPES}
    assert outputs == set()
    assert inputs <= INT64_INPUTS


def test_makefile_descriptor_target_writes_where_envoy_reads() -> None:
    makefile = (ROOT / "Makefile").read_text()
    relative = DESCRIPTOR_SET.relative_to(ROOT)
    assert f"DESCRIPTOR := {relative}\n" in makefile
    assert "gen_protos --descriptor-set $(DESCRIPTOR)" in makefile
    assert Path(ROOT / ".gitignore").read_text().count(f"/{relative.parent}/*.pb") == 1
