"""/openapi.json says what the gateway really answers: 400 (not FastAPI's 422) with the
OpenAI error body, real success schemas, SSE frame schemas. Uses the FAKE frontend for
error bodies; test_gateway_live.py checks real success bodies against the same document."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator

from gateway.anthropic_errors import speaks_anthropic

REF_PREFIX = "#/components/schemas/"


@pytest.fixture(scope="module")
def spec(gateway_url: str) -> dict[str, Any]:
    return httpx.get(f"{gateway_url}/openapi.json", timeout=10).json()


def validator(spec: dict[str, Any], name: str) -> Draft202012Validator:
    """A validator for one component schema of the served document."""
    schema = {"$ref": f"{REF_PREFIX}{name}", "components": spec["components"]}
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _operations(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


def test_no_fastapi_422_anywhere(spec: dict[str, Any]) -> None:
    for path, method, operation in _operations(spec):
        assert "422" not in operation["responses"], (path, method)
    assert not {"HTTPValidationError", "ValidationError"} & set(spec["components"]["schemas"])


def test_every_ref_resolves(spec: dict[str, Any]) -> None:
    names = set(spec["components"]["schemas"])
    for ref in _refs(spec):
        assert ref.startswith(REF_PREFIX) and ref.removeprefix(REF_PREFIX) in names, ref


def test_bodies_document_400_with_the_error_schema(spec: dict[str, Any]) -> None:
    """OpenAI's error body, or Anthropic's on Anthropic's routes."""
    for path, method, operation in _operations(spec):
        if "requestBody" not in operation:
            continue
        shape = "AnthropicErrorResponse" if speaks_anthropic(path) else "ErrorResponse"
        documented = operation["responses"]["400"]["content"]["application/json"]["schema"]
        assert documented == {"$ref": f"{REF_PREFIX}{shape}"}, (path, method)
        assert {"401", "413", "500", "503", "504"} <= set(operation["responses"])


@pytest.mark.parametrize(
    ("path", "frame"),
    [
        ("/v1/chat/completions", "ChatCompletionChunk"),
        ("/v1/completions", "Completion"),
        ("/generate", "GenerateOutput"),
    ],
)
def test_streaming_routes_document_their_sse_frame(
    spec: dict[str, Any], path: str, frame: str
) -> None:
    ok = spec["paths"][path]["post"]["responses"]["200"]
    assert ok["content"]["text/event-stream"]["schema"] == {"$ref": f"{REF_PREFIX}{frame}"}
    assert "[DONE]" in ok["description"]


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b'{"messages": [', 400),  # malformed JSON
        (b'{"messages": "not a list"}', 400),  # wrong type
        (b"x" * (2 << 20), 413),  # over the test gateway's 1 MiB limit
    ],
)
def test_error_bodies_match_the_documented_schema(
    gateway_url: str, spec: dict[str, Any], content: bytes, status: int
) -> None:
    resp = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert resp.status_code == status
    assert str(status) in spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    validator(spec, "ErrorResponse").validate(resp.json())


def test_schema_check_bites(spec: dict[str, Any]) -> None:
    """An undocumented key fails validation: the response schemas forbid extras."""
    body = {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    validator(spec, "ErrorResponse").validate(body)
    assert not validator(spec, "ErrorResponse").is_valid({"error": body["error"] | {"x": 1}})
