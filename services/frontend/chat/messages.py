"""ChatCompletionRequest protos -> the plain values a chat template receives.

Struct/Value protos hold every number as a double; JSON clients sent `1`, not
`1.0`, and a template that prints a tool schema with `tojson` must print what
the client sent, so integral doubles go back to ints here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from google.protobuf import json_format, struct_pb2
from tokenline.v1 import openai_pb2

from services.common.errors import InvalidArgumentError

ROLES = ("system", "developer", "user", "assistant", "tool")
# "openai": text parts are handed to the template as a list of {"type","text"};
# "string": parts are joined with "\n" (vLLM's rule) for templates that only print strings.
ContentFormat = Literal["openai", "string"]
# Names the template call itself sets; chat_template_kwargs may not override them.
_RESERVED_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
    | {"tokenize", "chat_template", "tool_choice"}
)
_MAX_EXACT_INT = 2**53
# OpenAI's values; the template decides what each means.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(slots=True)
class ChatInput:
    """Everything the template call takes, already validated."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    parallel_tool_calls: bool = True  # false: at most one call (not a template variable)


def plain(value: Any) -> Any:
    """Integral floats -> int, recursively (Struct stores every number as a double)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < _MAX_EXACT_INT:
        return int(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def _content(msg: openai_pb2.ChatMessage, index: int, fmt: ContentFormat) -> str | list[Any]:
    kind = msg.WhichOneof("content_kind")
    if kind == "content":
        return msg.content
    if kind is None:
        return ""
    parts = []
    for j, part in enumerate(msg.parts.parts):
        if part.type != "text":
            raise InvalidArgumentError(
                f"messages[{index}].content[{j}]: part type {part.type!r} is not supported "
                "(this server takes text parts only)",
                field="messages",
            )
        parts.append({"type": "text", "text": part.text})
    return parts if fmt == "openai" else "\n".join(p["text"] for p in parts)


def _tool_call(call: openai_pb2.ToolCall) -> dict[str, Any]:
    # Templates expect arguments as a mapping (HF convention); OpenAI sends JSON text.
    arguments: Any = call.function.arguments
    try:
        parsed = json.loads(arguments) if arguments else {}
        arguments = parsed if isinstance(parsed, dict) else arguments
    except json.JSONDecodeError:
        pass
    return {
        "id": call.id,
        "type": call.type or "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def message_to_dict(
    msg: openai_pb2.ChatMessage, index: int, fmt: ContentFormat = "openai"
) -> dict[str, Any]:
    if msg.role not in ROLES:
        raise InvalidArgumentError(
            f"messages[{index}].role {msg.role!r} is not one of {list(ROLES)}", field="messages"
        )
    check_role_fields(msg, index)
    out: dict[str, Any] = {"role": msg.role, "content": _content(msg, index, fmt)}
    if msg.name:
        out["name"] = msg.name
    if msg.tool_calls:
        out["tool_calls"] = [_tool_call(c) for c in msg.tool_calls]
    if msg.tool_call_id:
        out["tool_call_id"] = msg.tool_call_id
    if msg.reasoning_content:
        out["reasoning_content"] = msg.reasoning_content
    return out


def check_role_fields(msg: openai_pb2.ChatMessage, index: int) -> None:
    """The fields OpenAI's spec requires of each role: content for every role but an
    assistant that calls tools, and the call a tool result answers. A message without
    them would reach the template as an empty turn (and a model generates on from it)."""
    has_content = msg.WhichOneof("content_kind") is not None
    if not has_content and not (msg.role == "assistant" and msg.tool_calls):
        needs = "content or tool_calls" if msg.role == "assistant" else "content"
        raise InvalidArgumentError(
            f"a {msg.role} message needs {needs}", field=f"messages[{index}].content"
        )
    if msg.role == "tool" and not msg.tool_call_id:
        raise InvalidArgumentError(
            "a tool message needs the id of the call it answers",
            field=f"messages[{index}].tool_call_id",
        )


def tool_to_dict(tool: openai_pb2.Tool, index: int) -> dict[str, Any]:
    if tool.type not in ("", "function"):
        raise InvalidArgumentError(
            f"tools[{index}].type {tool.type!r} is not supported; use 'function'", field="tools"
        )
    if not tool.function.name:
        raise InvalidArgumentError(f"tools[{index}].function.name is required", field="tools")
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description:
        function["description"] = tool.function.description
    if tool.function.parameters_json:
        function["parameters"] = _parameters_from_json(tool.function.parameters_json, index)
    elif tool.function.HasField("parameters"):
        function["parameters"] = plain(json_format.MessageToDict(tool.function.parameters))
    return {"type": "function", "function": function}


def _parameters_from_json(text: str, index: int) -> dict[str, Any]:
    try:
        parameters = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(
            f"tools[{index}].function.parameters_json is not JSON: {exc}", field="tools"
        ) from None
    if not isinstance(parameters, dict):
        raise InvalidArgumentError(
            f"tools[{index}].function.parameters must be a JSON object", field="tools"
        )
    return parameters


def tool_choice_value(value: struct_pb2.Value, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    """OpenAI's tool_choice: "none" | "auto" | "required" | {"type": "function", ...}."""
    choice = plain(json_format.MessageToDict(value))
    names = {t["function"]["name"] for t in tools}
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidArgumentError(
                f"{choice!r} is not one of 'none', 'auto', 'required'", field="tool_choice"
            )
        if choice == "required" and not tools:
            raise InvalidArgumentError("'required' needs at least one tool", field="tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or name not in names:
        raise InvalidArgumentError(
            f"must name one of the request's tools {sorted(names)}", field="tool_choice"
        )
    return choice


def template_kwargs(request: openai_pb2.ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs, plus ``reasoning_effort`` (a template variable, as in vLLM)."""
    kwargs: dict[str, Any] = {}
    if request.HasField("chat_template_kwargs"):
        kwargs = plain(json_format.MessageToDict(request.chat_template_kwargs))
    clash = sorted(set(kwargs) & _RESERVED_KWARGS)
    if clash:
        raise InvalidArgumentError(
            f"{clash} are set by the request itself, not through chat_template_kwargs",
            field="chat_template_kwargs",
        )
    if request.HasField("reasoning_effort"):
        effort = request.reasoning_effort
        if effort not in REASONING_EFFORTS:
            raise InvalidArgumentError(
                f"{effort!r} is not one of {list(REASONING_EFFORTS)}", field="reasoning_effort"
            )
        if kwargs.get("reasoning_effort", effort) != effort:
            raise InvalidArgumentError(
                "differs from chat_template_kwargs.reasoning_effort", field="reasoning_effort"
            )
        kwargs["reasoning_effort"] = effort
    return kwargs


def chat_input(request: openai_pb2.ChatCompletionRequest, fmt: ContentFormat) -> ChatInput:
    """Validate the chat-specific fields and convert them for the template."""
    if not request.messages:
        raise InvalidArgumentError("at least one message is required", field="messages")
    messages = [message_to_dict(m, i, fmt) for i, m in enumerate(request.messages)]
    tools = [tool_to_dict(t, i) for i, t in enumerate(request.tools)]
    kwargs = template_kwargs(request)
    if request.HasField("tool_choice"):
        kwargs["tool_choice"] = tool_choice_value(request.tool_choice, tools)
    continue_final = request.continue_final_message
    add_generation_prompt = (
        request.add_generation_prompt
        if request.HasField("add_generation_prompt")
        else not continue_final
    )
    if continue_final and add_generation_prompt:
        raise InvalidArgumentError(
            "continue_final_message and add_generation_prompt cannot both be true",
            field="continue_final_message",
        )
    if continue_final and messages[-1]["role"] != "assistant":
        raise InvalidArgumentError(
            "continue_final_message needs a final assistant message",
            field="continue_final_message",
        )
    parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    return ChatInput(
        messages, tools or None, add_generation_prompt, continue_final, kwargs, parallel
    )
