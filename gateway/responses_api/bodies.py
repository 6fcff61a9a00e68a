"""The ``response`` object's JSON shape, as /openapi.json shows it (``render.py`` writes it)."""

from __future__ import annotations

from typing import Any, Literal

from gateway.responses import JsonBody


class ResponseUsageBody(JsonBody):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int


class ResponseErrorBody(JsonBody):
    code: str
    message: str


class ResponseObject(JsonBody):
    """A ``response``; streamed, ``response.created`` carries it ``in_progress`` and with no
    output, ``response.completed`` / ``response.incomplete`` whole."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
    error: ResponseErrorBody | None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list[dict[str, Any]]
    parallel_tool_calls: bool
    text: dict[str, Any]
    output: list[dict[str, Any]]  # message | function_call | reasoning items
    usage: ResponseUsageBody | None
    metadata: dict[str, str]
    store: bool
    previous_response_id: str | None
    background: bool


class ResponseItemListObject(JsonBody):
    """A page of a response's input items, in ``order`` (newest first by default)."""

    object: Literal["list"]
    data: list[dict[str, Any]]  # message | function_call | function_call_output items
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeletedObject(JsonBody):
    id: str
    object: Literal["response"]
    deleted: bool
