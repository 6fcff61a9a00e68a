"""ChatCompletionRequest -> prompt text via the model's own chat template."""

from __future__ import annotations

from typing import Any

import jinja2
from google.protobuf import json_format
from tokenline.v1 import openai_pb2
from transformers import PreTrainedTokenizerBase

from services.common.errors import InvalidArgumentError

_ROLES = {"system", "developer", "user", "assistant", "tool"}


def message_to_dict(msg: openai_pb2.ChatMessage, index: int) -> dict[str, Any]:
    if msg.role not in _ROLES:
        raise InvalidArgumentError(
            f"messages[{index}].role {msg.role!r} is not one of {sorted(_ROLES)}", field="messages"
        )
    out: dict[str, Any] = {"role": msg.role}
    kind = msg.WhichOneof("content_kind")
    if kind == "parts":
        texts = []
        for part in msg.parts.parts:
            if part.type != "text":
                raise InvalidArgumentError(
                    f"messages[{index}]: content part type {part.type!r} is not supported",
                    field="messages",
                )
            texts.append(part.text)
        out["content"] = "".join(texts)
    else:
        out["content"] = msg.content if kind == "content" else ""
    if msg.name:
        out["name"] = msg.name
    if msg.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type or "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in msg.tool_calls
        ]
    if msg.tool_call_id:
        out["tool_call_id"] = msg.tool_call_id
    if msg.reasoning_content:
        out["reasoning_content"] = msg.reasoning_content
    return out


def render_chat(
    tokenizer: PreTrainedTokenizerBase, request: openai_pb2.ChatCompletionRequest
) -> str:
    """The prompt text, exactly as ``transformers``' apply_chat_template renders it."""
    if not request.messages:
        raise InvalidArgumentError("at least one message is required", field="messages")
    messages = [message_to_dict(m, i) for i, m in enumerate(request.messages)]
    tools = [json_format.MessageToDict(t, preserving_proto_field_name=True) for t in request.tools]
    kwargs = (
        json_format.MessageToDict(request.chat_template_kwargs)
        if request.HasField("chat_template_kwargs")
        else {}
    )
    if request.HasField("tool_choice"):
        kwargs.setdefault("tool_choice", json_format.MessageToDict(request.tool_choice))
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
            "continue_final_message needs a final assistant message", field="messages"
        )
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            tokenize=False,
            **kwargs,
        )
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        raise InvalidArgumentError(f"chat template failed: {exc}", field="messages") from exc
