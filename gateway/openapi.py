"""/openapi.json as the gateway really answers.

FastAPI documents a 422 `HTTPValidationError` for every route with a body, but the
gateway turns validation failures into 400 with the OpenAI error body (gateway/errors.py),
and routes return rendered dicts, so their success bodies are declared here from
gateway/responses.py, with the SSE frame schema for streaming routes.
"""

from __future__ import annotations

from typing import Any, cast

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from gateway.responses import ChatCompletionChunk, Completion, ErrorResponse, GenerateOutput

REF_TEMPLATE = "#/components/schemas/{model}"
_ERRORS: dict[int, str] = {
    400: "Invalid request: malformed JSON, a wrong type or a value out of range; "
    "`error.param` names the field",
    401: "Missing or wrong `Authorization: Bearer` key (only when the gateway has --api-key)",
    404: "Unknown model or route",
    409: "A request with this X-Request-Id is already in flight",
    413: "Request body over --max-body-bytes",
    429: "A service is at capacity; retry later",
    500: "Internal error (no traceback is ever sent)",
    503: "The frontend or a service behind it is unavailable",
    504: "The request ran past --request-timeout",
}
# Who can answer what: every API route may see 401/500/503/504.
_ALWAYS = (401, 500, 503, 504)
GENERATION_ERRORS = (400, 404, 409, 413, 429, *_ALWAYS)
BODY_ERRORS = (400, 413, *_ALWAYS)
READ_ERRORS = _ALWAYS
_SSE_NOTE = (
    " With `stream: true`: `text/event-stream`, one `data: {json}` frame per message, "
    "then `data: [DONE]`. An error after the first frame is a single "
    '`data: {"error": {...}}` frame (ErrorResponse) and the stream ends without [DONE].'
)
# SSE frame schemas; each goes into components, so text/event-stream content can $ref it.
STREAM_FRAMES: tuple[type[BaseModel], ...] = (ChatCompletionChunk, Completion, GenerateOutput)


def error_responses(statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def responses(
    ok: type[BaseModel],
    description: str,
    errors: tuple[int, ...],
    *,
    stream_frame: type[BaseModel] | None = None,
) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: its 200 body (and SSE frame, if it streams) and errors."""
    success: dict[str, Any] = {"model": ok, "description": description}
    if stream_frame is not None:
        if stream_frame not in STREAM_FRAMES:
            raise ValueError(f"{stream_frame.__name__} is not in STREAM_FRAMES")
        ref = {"$ref": REF_TEMPLATE.format(model=stream_frame.__name__)}
        success["content"] = {"text/event-stream": {"schema": ref}}
        success["description"] = description + _SSE_NOTE
    return {200: success, **error_responses(errors)}


def _without_fastapi_422(schema: dict[str, Any]) -> None:
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _with_stream_frames(schema: dict[str, Any]) -> None:
    models = [(m, cast(JsonSchemaMode, "serialization")) for m in STREAM_FRAMES]
    _, defs = models_json_schema(models, ref_template=REF_TEMPLATE)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in defs.get("$defs", {}).items():
        components.setdefault(name, definition)


def install_openapi(app: FastAPI) -> None:
    """Serve the corrected document at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
            )
            _without_fastapi_422(schema)
            _with_stream_frames(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
