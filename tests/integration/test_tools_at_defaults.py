"""Tools and message validation at the defaults: the shared stack's frontend runs no
``--tool-call-parser``, as ``make run`` does.

``"required"`` and a named function still give valid tool calls, unary and streamed alike
(the grammar forces plain JSON that the server reads back: tests/integration/forced_calls.py);
``"auto"`` needs a parser and is refused naming the flag. A message missing a field OpenAI's
spec requires of its role is a 400 naming it (a stream fails before its first frame) and
INVALID_ARGUMENT with the field for a gRPC client.
"""

from __future__ import annotations

from typing import Any

import grpc
import openai
import pytest
from google.protobuf import json_format
from tokenline.v1 import frontend_pb2_grpc, openai_pb2

from services.common.errors import field_of
from services.common.tls import open_sync_channel
from services.launch import LocalStack
from tests.integration.forced_calls import ask, check_forced_calls


def test_a_named_function_needs_no_parser(client: openai.OpenAI, model_id: str) -> None:
    check_forced_calls(client, model_id, {"type": "function", "function": {"name": "get_weather"}})


def test_required_needs_no_parser(client: openai.OpenAI, model_id: str) -> None:
    """``parallel_tool_calls: false`` makes the grammar end the list after one call: the
    random model, left to choose, keeps writing ``, `` and calls until its budget runs out
    (more calls in one list: tests/frontend/parsers/test_json_tool_calls.py)."""
    check_forced_calls(client, model_id, "required", parallel_tool_calls=False)


def test_auto_is_refused_naming_the_flag(client: openai.OpenAI, model_id: str) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, model_id, 0, "auto", stream=stream)
        assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
        assert "--tool-call-parser" in info.value.body["message"]  # type: ignore[index]


def test_one_call_under_auto_is_refused(client: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, model_id, 0, None, parallel_tool_calls=False)
    assert info.value.body["param"] == "parallel_tool_calls"  # type: ignore[index]


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD_MESSAGES: list[tuple[dict[str, Any], str]] = [
    ({"role": "user"}, "content"),
    ({"role": "system"}, "content"),
    ({"role": "assistant"}, "content"),
    ({"role": "tool", "tool_call_id": "call_1"}, "content"),
    ({"role": "tool", "content": "18 C"}, "tool_call_id"),
]


@pytest.mark.parametrize(("message", "field"), BAD_MESSAGES)
def test_a_message_missing_a_required_field_is_a_400_naming_it(
    client: openai.OpenAI, model_id: str, message: dict[str, Any], field: str
) -> None:
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [CALL]}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=model_id, messages=[*turns, message], max_tokens=4, stream=stream
            )  # type: ignore[call-overload]
        assert info.value.body["param"] == f"messages[2].{field}"  # type: ignore[index]
        assert "Traceback" not in str(info.value.body)


def test_a_grpc_client_gets_invalid_argument_with_the_field(stack: LocalStack) -> None:
    request = json_format.ParseDict(
        {"messages": [{"role": "user"}], "sampling": {"maxTokens": 4}},
        openai_pb2.ChatCompletionRequest(),
    )
    with open_sync_channel(stack.addr("frontend"), stack.tls) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ChatCompletion(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert field_of(info.value) == "messages[0].content"  # type: ignore[arg-type]
