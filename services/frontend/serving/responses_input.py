"""A Responses request as the chat request it means, so Responses are served by the chat
path (template, tool choice, structured output, sampling) and nothing is done twice.

Errors that chat validation raises name chat's fields; ``responses_field`` names the
Responses field the client actually sent."""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf import json_format, struct_pb2
from tokenline.v1 import openai_pb2, responses_pb2

from services.common.errors import InvalidArgumentError

# Responses content part types → chat's; any other type reaches chat as sent and is refused.
_PART_TYPES = {"input_text": "text", "output_text": "text", "text": "text"}
# chat field (prefix) → the Responses field it came from.
_FIELD_OF = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


def responses_field(field: str | None) -> str | None:
    """The Responses field for a chat field named by a validation error."""
    if field is None:
        return None
    for chat, ours in _FIELD_OF.items():
        if field == chat or field.startswith((chat + ".", chat + "[")):
            return ours + field[len(chat) :]
    return field


def chat_request_of(
    request: responses_pb2.ResponsesRequest,
    *,
    stream: bool,
    history: Sequence[openai_pb2.ChatMessage] = (),
) -> openai_pb2.ChatCompletionRequest:
    """The chat request for ``request`` after ``history`` (a stored conversation it
    continues); ``stream`` asks for the usage chunk a stream needs."""
    _check_strict(request)
    chat = openai_pb2.ChatCompletionRequest(
        model=request.model,
        messages=[*_instructions(request), *history, *input_messages(request)],
        stream=stream,
        tools=[_tool(t) for t in request.tools],
        user=request.user,
        request_id=request.request_id,
    )
    if stream:
        chat.stream_options.include_usage = True
    if request.HasField("tool_choice"):
        chat.tool_choice.CopyFrom(_tool_choice(request.tool_choice))
    if request.HasField("parallel_tool_calls"):
        chat.parallel_tool_calls = request.parallel_tool_calls
    if request.HasField("reasoning_effort"):
        chat.reasoning_effort = request.reasoning_effort
    if request.HasField("max_output_tokens"):
        chat.max_completion_tokens = request.max_output_tokens
    _sampling_into(chat.sampling, request)
    return chat


def _check_strict(request: responses_pb2.ResponsesRequest) -> None:
    """``strict`` tools are held to their schema only by a forced choice's grammar."""
    choice = (
        json_format.MessageToDict(request.tool_choice) if request.HasField("tool_choice") else None
    )
    if choice == "required" or isinstance(choice, dict):
        return
    for index, tool in enumerate(request.tools):
        if tool.HasField("strict") and tool.strict:
            raise InvalidArgumentError(
                "true needs tool_choice 'required' or a named function (only a forced call "
                "is held to its schema); send false or force the call",
                field=f"tools[{index}].strict",
            )


def _sampling_into(out: openai_pb2.OpenAISampling, request: responses_pb2.ResponsesRequest) -> None:
    for name in ("temperature", "top_p", "seed"):
        if request.HasField(name):  # type: ignore[arg-type]
            setattr(out, name, getattr(request, name))
    fmt = request.text_format
    if request.HasField("text_format") and fmt.type != "text":
        out.response_format.type = fmt.type
        if fmt.type == "json_schema":
            spec = out.response_format.json_schema
            spec.name, spec.description, spec.schema_json = (
                fmt.name,
                fmt.description,
                fmt.schema_json,
            )
            if fmt.HasField("strict"):
                spec.strict = fmt.strict


def _instructions(request: responses_pb2.ResponsesRequest) -> list[openai_pb2.ChatMessage]:
    """A system message; a continuation does not inherit it (OpenAI's rule)."""
    if not request.instructions:
        return []
    return [openai_pb2.ChatMessage(role="system", content=request.instructions)]


def input_messages(request: responses_pb2.ResponsesRequest) -> list[openai_pb2.ChatMessage]:
    """``input`` as chat messages."""
    out: list[openai_pb2.ChatMessage] = []
    kind = request.WhichOneof("input_kind")
    if kind == "input_text":
        out.append(openai_pb2.ChatMessage(role="user", content=request.input_text))
    elif kind == "input_items":
        for index, item in enumerate(request.input_items.items):
            _add_item(out, item, index)
    return out


def _add_item(
    out: list[openai_pb2.ChatMessage], item: responses_pb2.ResponsesInputItem, index: int
) -> None:
    """Append ``item``; consecutive function calls share one assistant message, as chat
    writes parallel calls."""
    kind = item.type or "message"
    if kind == "message":
        out.append(_message(item))
    elif kind == "function_call":
        if not out or out[-1].role != "assistant" or not out[-1].tool_calls:
            out.append(openai_pb2.ChatMessage(role="assistant"))
        calls = out[-1].tool_calls
        fn = openai_pb2.ToolCallFunction(name=item.name, arguments=item.arguments)
        calls.add(id=item.call_id, type="function", function=fn, index=len(calls))
    elif kind == "function_call_output":
        out.append(
            openai_pb2.ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output)
        )
    else:
        raise InvalidArgumentError(
            f"{kind!r} is not one of 'message', 'function_call', 'function_call_output'",
            field=f"input[{index}].type",
        )


def _message(item: responses_pb2.ResponsesInputItem) -> openai_pb2.ChatMessage:
    msg = openai_pb2.ChatMessage(role=item.role)
    if item.WhichOneof("content_kind") == "content":
        msg.content = item.content
    elif item.WhichOneof("content_kind") == "parts":
        msg.parts.SetInParent()
        for part in item.parts.parts:
            msg.parts.parts.add(type=_PART_TYPES.get(part.type, part.type), text=part.text)
    return msg


def _tool(tool: responses_pb2.ResponsesTool) -> openai_pb2.Tool:
    out = openai_pb2.Tool(type=tool.type)
    out.function.name = tool.name
    out.function.description = tool.description
    out.function.parameters_json = tool.parameters_json
    return out


def _tool_choice(value: struct_pb2.Value) -> struct_pb2.Value:
    """Responses name a function flat (``{type, name}``); chat nests it under ``function``."""
    given = json_format.MessageToDict(value)
    if not isinstance(given, dict) or given.get("type") != "function" or "function" in given:
        return value
    out = struct_pb2.Value()
    out.struct_value.update({"type": "function", "function": {"name": given.get("name", "")}})
    return out


def output_message(response: responses_pb2.Response) -> openai_pb2.ChatMessage:
    """A response's output as the assistant turn a continuation shows the template."""
    out = openai_pb2.ChatMessage(role="assistant")
    for item in response.output:
        if item.type == "message":
            out.content = out.content + "".join(part.text for part in item.content)
        elif item.type == "reasoning":
            out.reasoning_content += item.reasoning_text
        else:
            fn = openai_pb2.ToolCallFunction(name=item.name, arguments=item.arguments)
            out.tool_calls.add(
                id=item.call_id, type="function", function=fn, index=len(out.tool_calls)
            )
    return out
