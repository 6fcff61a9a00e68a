"""Anthropic Messages bodies → the chat request the frontend already serves.

A Messages request is a chat request in other clothes: ``system`` becomes the first
message, a user turn's ``tool_result`` blocks become ``tool`` messages (in order, before
its text), an assistant turn's ``tool_use`` blocks become its ``tool_calls``, and a final
assistant turn is continued rather than answered (Anthropic's prefill). The chat body is
then built into a proto by ``gateway/convert.py``, the chat route's own code. Every refusal
names the field in the client's spelling (``messages[0].content[1].type``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from tokenline.v1 import openai_pb2

from gateway.anthropic.schemas import (
    ContentBlockBody,
    MessageParamBody,
    MessagesBody,
    ToolParamBody,
)
from gateway.convert import chat_request_to_proto
from gateway.errors import GatewayError
from gateway.schemas import (
    ChatCompletionBody,
    ChatMessageBody,
    ContentPartBody,
    FunctionBody,
    ToolBody,
    ToolCallBody,
    ToolCallFunctionBody,
)

# Which block types each role may send; any other type is refused by name.
_BLOCKS_OF = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}
# A failed tool's result, as the model reads it (Anthropic's `is_error: true`).
ERROR_PREFIX = "Error: "


def refuse(param: str, why: str) -> GatewayError:
    return GatewayError(400, f"{param}: {why}", param=param, code="invalid_value")


def _required(value: Any, param: str) -> Any:
    if value is None:
        raise refuse(param, "required")
    return value


def _text_of(block: ContentBlockBody, param: str) -> str:
    if block.type != "text":
        raise refuse(f"{param}.type", f"block type {block.type!r} is not supported here (text is)")
    return str(_required(block.text, f"{param}.text"))


def _text_parts(blocks: list[ContentBlockBody], param: str) -> list[ContentPartBody]:
    return [
        ContentPartBody(type="text", text=_text_of(b, f"{param}[{i}]"))
        for i, b in enumerate(blocks)
    ]


def _tool_result(block: ContentBlockBody, param: str) -> ChatMessageBody:
    call_id = _required(block.tool_use_id, f"{param}.tool_use_id")
    given = block.content if block.content is not None else ""
    if isinstance(given, str):
        text = given
    else:
        text = "".join(p.text or "" for p in _text_parts(given, f"{param}.content"))
    if block.is_error:
        text = ERROR_PREFIX + text
    return ChatMessageBody(role="tool", content=text, tool_call_id=call_id)


def _tool_call(block: ContentBlockBody, param: str) -> ToolCallBody:
    arguments = json.dumps(_required(block.input, f"{param}.input"), ensure_ascii=False)
    name = _required(block.name, f"{param}.name")
    function = ToolCallFunctionBody(name=name, arguments=arguments)
    return ToolCallBody(id=_required(block.id, f"{param}.id"), function=function)


def _checked_blocks(message: MessageParamBody, param: str) -> list[ContentBlockBody]:
    if isinstance(message.content, str):
        return [ContentBlockBody(type="text", text=message.content)]
    allowed = _BLOCKS_OF[message.role]
    for i, block in enumerate(message.content):
        if block.type not in allowed:
            why = f"block type {block.type!r} is not supported in a {message.role} turn"
            raise refuse(f"{param}.content[{i}].type", f"{why} ({', '.join(allowed)} are)")
    return message.content


def _user_turn(message: MessageParamBody, param: str) -> Iterator[ChatMessageBody]:
    """Each tool_result as a tool message, each run of text blocks as one user message."""
    texts: list[ContentPartBody] = []
    for i, block in enumerate(_checked_blocks(message, param)):
        where = f"{param}.content[{i}]"
        if block.type == "text":
            texts.append(ContentPartBody(type="text", text=_text_of(block, where)))
            continue
        if texts:
            yield ChatMessageBody(role="user", content=texts)
            texts = []
        yield _tool_result(block, where)
    if texts or isinstance(message.content, list) and not message.content:
        yield ChatMessageBody(role="user", content=texts)


def _assistant_turn(message: MessageParamBody, param: str) -> ChatMessageBody:
    text, calls = "", []
    for i, block in enumerate(_checked_blocks(message, param)):
        where = f"{param}.content[{i}]"
        if block.type == "text":
            text += _text_of(block, where)
        else:
            calls.append(_tool_call(block, where))
    return ChatMessageBody(role="assistant", content=text, tool_calls=calls or None)


def _system(system: str | list[ContentBlockBody]) -> ChatMessageBody:
    content = system if isinstance(system, str) else _text_parts(system, "system")
    return ChatMessageBody(role="system", content=content)


def chat_messages(body: MessagesBody) -> list[ChatMessageBody]:
    if not body.messages:
        raise refuse("messages", "at least one message is required")
    out = [_system(body.system)] if body.system is not None else []
    for i, message in enumerate(body.messages):
        if message.role == "user":
            out.extend(_user_turn(message, f"messages[{i}]"))
        else:
            out.append(_assistant_turn(message, f"messages[{i}]"))
    return out


def _tool(tool: ToolParamBody, index: int) -> ToolBody:
    if tool.type not in (None, "custom"):
        why = f"server tool {tool.type!r} is not supported (client tools are)"
        raise refuse(f"tools[{index}].type", why)
    function = FunctionBody(
        name=tool.name, description=tool.description, parameters=tool.input_schema
    )
    return ToolBody(function=function)


def _tool_choice(body: MessagesBody) -> dict[str, Any]:
    """Anthropic's choice as chat's: auto → "auto", any → "required", tool → a named
    function, none → "none"; ``disable_parallel_tool_use`` → ``parallel_tool_calls: false``."""
    choice = body.tool_choice
    if choice is None:
        return {}
    fields: dict[str, Any] = {"tool_choice": {"any": "required"}.get(choice.type, choice.type)}
    if choice.type == "tool":
        name = _required(choice.name, "tool_choice.name")
        fields["tool_choice"] = {"type": "function", "function": {"name": name}}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _check_thinking(body: MessagesBody) -> None:
    if body.thinking is not None and body.thinking.type != "disabled":
        raise refuse("thinking.type", "extended thinking is not supported (only 'disabled' is)")


def chat_body(body: MessagesBody) -> ChatCompletionBody:
    """The chat request a Messages request means."""
    _check_thinking(body)
    messages = chat_messages(body)
    is_prefill = body.messages[-1].role == "assistant"
    return ChatCompletionBody(
        model=body.model,
        messages=messages,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences,
        stream=body.stream,
        tools=[_tool(t, i) for i, t in enumerate(body.tools)] if body.tools else None,
        continue_final_message=is_prefill,
        add_generation_prompt=not is_prefill,
        **_tool_choice(body),
    )


def messages_request_to_proto(
    body: MessagesBody, request_id: str
) -> openai_pb2.ChatCompletionRequest:
    """The frontend's ChatCompletionRequest for a Messages body. A stream asks for usage
    (message_delta reports it) and for the prompt's ids (message_start reports their count)."""
    proto = chat_request_to_proto(chat_body(body), request_id)
    if body.stream:
        proto.stream_options.include_usage = True
        proto.return_token_ids = True
    return proto
