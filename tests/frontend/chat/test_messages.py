"""Each role's required fields (OpenAI's spec), checked before the template sees a message:
a missing one is INVALID_ARGUMENT naming the field, and every valid shape still passes."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format
from tokenline.v1 import openai_pb2

from services.common.errors import InvalidArgumentError
from services.frontend.chat.messages import chat_input

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def request(*messages: dict[str, Any]) -> openai_pb2.ChatCompletionRequest:
    return json_format.ParseDict({"messages": list(messages)}, openai_pb2.ChatCompletionRequest())


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "user"}, "content"),
        ({"role": "system"}, "content"),
        ({"role": "developer"}, "content"),
        ({"role": "assistant"}, "content"),
        ({"role": "tool", "toolCallId": "call_1"}, "content"),
        ({"role": "tool", "content": "18 C"}, "tool_call_id"),
    ],
)
def test_a_missing_required_field_is_refused_by_name(message: dict[str, Any], field: str) -> None:
    first = {"role": "user", "content": "Weather?"}
    with pytest.raises(InvalidArgumentError) as info:
        chat_input(request(first, message), "openai")
    assert info.value.field == f"messages[1].{field}"
    assert message["role"] in info.value.message


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": ""},  # present, if empty
        {"role": "user", "parts": {"parts": [{"type": "text", "text": "hi"}]}},
        {"role": "assistant", "toolCalls": [CALL]},  # content may go with tool_calls
        {"role": "assistant", "content": "", "toolCalls": [CALL]},
        {"role": "tool", "content": "18 C", "toolCallId": "call_1"},
    ],
)
def test_every_role_with_its_fields_passes(message: dict[str, Any]) -> None:
    chat = chat_input(request({"role": "user", "content": "Weather?"}, message), "openai")
    assert chat.messages[1]["role"] == message["role"]
