"""Responses protos → OpenAI's JSON: the response object, and each stream event as an SSE
``event:``/``data:`` frame with its ``sequence_number``."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from tokenline.v1 import responses_pb2

from gateway.errors import GatewayError
from gateway.sse import KEEPALIVE_COMMENT


def _tool(tool: responses_pb2.ResponsesTool) -> dict[str, Any]:
    return {
        "type": tool.type,
        "name": tool.name,
        "description": tool.description or None,
        "parameters": json.loads(tool.parameters_json) if tool.parameters_json else None,
        "strict": tool.strict if tool.HasField("strict") else None,
    }


def _format(fmt: responses_pb2.ResponsesTextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    out: dict[str, Any] = {"type": "json_schema", "name": fmt.name}
    out["schema"] = json.loads(fmt.schema_json) if fmt.schema_json else {}
    out["description"] = fmt.description or None
    out["strict"] = fmt.strict if fmt.HasField("strict") else None
    return out


def item_to_dict(item: responses_pb2.ResponseOutputItem) -> dict[str, Any]:
    """An output item, or an input item of ``input_items``."""
    head = {"type": item.type, "id": item.id, "status": item.status}
    if item.type == "function_call":
        return head | {"call_id": item.call_id, "name": item.name, "arguments": item.arguments}
    if item.type == "function_call_output":
        return head | {"call_id": item.call_id, "output": item.output}
    if item.type == "reasoning":
        text = [{"type": "reasoning_text", "text": item.reasoning_text}]
        return head | {"summary": [], "content": text}
    return head | {"role": item.role, "content": [_part(p) for p in item.content]}


def _part(part: responses_pb2.ResponseOutputText) -> dict[str, Any]:
    if part.type != "output_text":  # an input item's input_text
        return {"type": part.type, "text": part.text}
    return {"type": part.type, "text": part.text, "annotations": [], "logprobs": []}


def _usage(usage: responses_pb2.ResponseUsage) -> dict[str, Any]:
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def _optional(response: responses_pb2.Response, name: str) -> Any:
    return getattr(response, name) if response.HasField(name) else None  # type: ignore[arg-type]


def response_to_dict(response: responses_pb2.Response) -> dict[str, Any]:
    """OpenAI's ``response`` object."""
    reason = response.incomplete_reason
    return {
        "id": response.id,
        "object": "response",
        "created_at": response.created_at,
        "model": response.model,
        "status": response.status,
        "error": _error(response),
        "incomplete_details": {"reason": reason} if reason else None,
        "instructions": response.instructions or None,
        "max_output_tokens": _optional(response, "max_output_tokens"),
        "temperature": _optional(response, "temperature"),
        "top_p": _optional(response, "top_p"),
        "tool_choice": json_format.MessageToDict(response.tool_choice),
        "tools": [_tool(t) for t in response.tools],
        "parallel_tool_calls": response.parallel_tool_calls,
        "text": {"format": _format(response.text_format)},
        "output": [item_to_dict(i) for i in response.output],
        "usage": _usage(response.usage) if response.HasField("usage") else None,
        "metadata": {},
        "store": response.store,
        "previous_response_id": response.previous_response_id or None,
        "background": response.background,
    }


def _error(response: responses_pb2.Response) -> dict[str, str] | None:
    if not response.HasField("error"):
        return None
    return {"code": response.error.code, "message": response.error.message}


def item_list_to_dict(page: responses_pb2.ResponseItemList) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: OpenAI's list."""
    return {
        "object": "list",
        "data": [item_to_dict(i) for i in page.data],
        "first_id": page.first_id or None,
        "last_id": page.last_id or None,
        "has_more": page.has_more,
    }


_TEXT_EVENTS = ("output_text", "reasoning_text", "content_part")


def event_to_dict(event: responses_pb2.ResponseStreamEvent) -> dict[str, Any]:
    """One event in OpenAI's shape: the fields its type carries, no others."""
    out: dict[str, Any] = {"type": event.type, "sequence_number": event.sequence_number}
    kind = event.type.removeprefix("response.")
    if event.HasField("response"):
        return out | {"response": response_to_dict(event.response)}
    out["output_index"] = event.output_index
    if kind.startswith("output_item."):
        return out | {"item": item_to_dict(event.item)}
    out["item_id"] = event.item_id
    if kind.startswith(_TEXT_EVENTS):
        out["content_index"] = event.content_index
    if kind.startswith("content_part."):
        return out | {"part": _part(event.part)}
    if kind.endswith(".delta"):
        out["delta"] = event.delta
    elif kind == "function_call_arguments.done":
        out["arguments"] = event.arguments
    else:
        out["text"] = event.text
    if kind.startswith("output_text."):
        out["logprobs"] = []
    return out


def _frame(name: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return f"event: {name}\ndata: {data}\n\n".encode()


class ResponseFrames:
    """The stream's SSE frames (a ``gateway/sse.py`` Framer). OpenAI ends a Responses
    stream with its last event (no ``[DONE]``); a failure after the first frame is one
    ``error`` event; the keep-alive is an SSE comment."""

    def __init__(self) -> None:
        self._next_seq = 0

    def event(self, event: responses_pb2.ResponseStreamEvent) -> bytes:
        self._next_seq = event.sequence_number + 1
        return _frame(event.type, event_to_dict(event))

    def end(self) -> bytes:
        return b""

    def fail(self, err: GatewayError) -> bytes:
        body = {"type": "error", "sequence_number": self._next_seq, **err.body()}
        return _frame("error", body)

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT
