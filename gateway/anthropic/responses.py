"""Anthropic Messages response bodies: the one definition of each JSON shape the route
writes (and what /openapi.json shows for it)."""

from __future__ import annotations

from typing import Any, Literal

from gateway.responses import JsonBody

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(JsonBody):
    input_tokens: int
    output_tokens: int


class TextBlock(JsonBody):
    type: Literal["text"]
    text: str


class ToolUseBlock(JsonBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageResponse(JsonBody):
    """A ``message``; while streaming, ``message_start`` carries it with no content yet
    and a null ``stop_reason``."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class AnthropicErrorObject(JsonBody):
    type: str
    message: str = ""


class AnthropicErrorResponse(JsonBody):
    """Every failure on /v1/messages: ``error.message`` starts with the field it names."""

    type: Literal["error"]
    error: AnthropicErrorObject
