"""The Messages → chat translation (gateway/anthropic/convert.py) and the error shape
(gateway/anthropic_errors.py), in-process: what the frontend is asked, and what is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.anthropic.convert import ERROR_PREFIX, chat_body, messages_request_to_proto
from gateway.anthropic.schemas import MessagesBody
from gateway.anthropic_errors import anthropic_error_body, dotted
from gateway.errors import GatewayError

TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def body(**fields: Any) -> MessagesBody:
    data = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]} | fields
    return MessagesBody.model_validate(data)


def refused(**fields: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        chat_body(body(**fields))
    assert info.value.status == 400
    assert info.value.message.startswith(f"{info.value.param}: ")
    return info.value


def test_system_blocks_become_the_first_message() -> None:
    chat = chat_body(body(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]))
    first = chat.messages[0]
    assert first.role == "system" and isinstance(first.content, list)
    assert [p.text for p in first.content] == ["A", "B"]
    assert chat_body(body(system="S")).messages[0].content == "S"


def test_a_tool_round_trip_becomes_tool_calls_and_tool_messages_in_order() -> None:
    turns = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "let me"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
            {"type": "tool_use", "id": "t2", "name": "f", "input": {"a": 2}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
             "content": [{"type": "text", "text": "bo"}, {"type": "text", "text": "om"}]},
            {"type": "text", "text": "and?"},
        ]},
    ]  # fmt: skip
    messages = chat_body(body(messages=turns)).messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool", "user"]
    calls = messages[1].tool_calls or []
    assert messages[1].content == "let me"
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("t1", "f", {"a": 1}),
        ("t2", "f", {"a": 2}),
    ]
    assert (messages[2].tool_call_id, messages[2].content) == ("t1", "one")
    assert (messages[3].tool_call_id, messages[3].content) == ("t2", ERROR_PREFIX + "boom")
    assert [p.text for p in messages[4].content or []] == ["and?"]  # type: ignore[union-attr]


def test_a_final_assistant_turn_is_continued() -> None:
    prefill = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    chat = chat_body(body(messages=prefill))
    assert chat.continue_final_message and chat.add_generation_prompt is False
    answered = chat_body(body())
    assert not answered.continue_final_message and answered.add_generation_prompt


@pytest.mark.parametrize(
    ("choice", "tool_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "none"}, "none", None),
        ({"type": "any"}, "required", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}, None),
    ],
)
def test_tool_choice_maps_onto_chat(choice: Any, tool_choice: Any, parallel: Any) -> None:
    chat = chat_body(body(tools=[TOOL], tool_choice=choice))
    assert chat.tool_choice == tool_choice and chat.parallel_tool_calls is parallel
    assert chat.tools is not None and chat.tools[0].function.parameters == TOOL["input_schema"]


def test_sampling_and_stop_sequences_reach_the_proto() -> None:
    proto = messages_request_to_proto(
        body(temperature=0.5, top_p=0.9, top_k=7, stop_sequences=["\n\n", "END"]), "rid"
    )
    sampling = proto.sampling
    assert (sampling.max_tokens, sampling.top_k, list(sampling.stop)) == (4, 7, ["\n\n", "END"])
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert not proto.stream and not proto.stream_options.include_usage


def test_a_stream_asks_for_usage_and_the_prompt_ids() -> None:
    proto = messages_request_to_proto(body(stream=True), "rid")
    assert proto.stream and proto.stream_options.include_usage and proto.return_token_ids


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "thinking"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]},
         "messages[0].content[0].input"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
         "messages[0].content[0].content[0].type"),
        ({"system": [{"type": "image"}]}, "system[0].type"),
        ({"tools": [TOOL | {"type": "bash_20250124"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"thinking": {"type": "enabled"}}, "thinking.type"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(**fields).param == param


def test_a_refused_block_names_its_type() -> None:
    err = refused(messages=[{"role": "user", "content": [{"type": "document"}]}])
    assert "'document'" in err.message


def test_the_error_shape_names_the_field_dotted() -> None:
    assert dotted("messages[0].content[12].type") == "messages.0.content.12.type"
    assert dotted("stop") == "stop_sequences"
    assert anthropic_error_body(400, "messages[1].role: bad", "messages[1].role") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "messages.1.role: bad"},
    }
    assert anthropic_error_body(503, "down")["error"]["type"] == "overloaded_error"
    assert anthropic_error_body(500, "boom")["error"]["type"] == "api_error"
