"""Chat rendering against transformers' own apply_chat_template on the same model directory."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from tokenline.v1 import openai_pb2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.common.errors import InvalidArgumentError
from services.common.tokenizer import load_tokenizer
from services.frontend.chat.messages import chat_input
from services.frontend.chat.template import ChatTemplate, loses_control_tokens

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there."},
    {"role": "assistant", "content": "Hello."},
    {"role": "developer", "content": "Answer in French."},
    {"role": "user", "content": "How are you?"},
]


def request(messages: list[dict[str, Any]], **fields: Any) -> openai_pb2.ChatCompletionRequest:
    """OpenAI-shaped JSON -> the request proto: parts as ContentParts, each tool's
    schema as its JSON text (parameters_json) so key order survives."""
    pb_messages = []
    for m in copy.deepcopy(messages):
        if isinstance(m.get("content"), list):
            m["parts"] = {"parts": m.pop("content")}
        pb_messages.append(m)
    tools = []
    for tool in copy.deepcopy(fields.pop("tools", [])):
        if "parameters" in tool.get("function", {}):
            tool["function"]["parametersJson"] = json.dumps(tool["function"].pop("parameters"))
        tools.append(tool)
    body = {"messages": pb_messages, "tools": tools, **fields}
    return json_format.ParseDict(body, openai_pb2.ChatCompletionRequest())


@pytest.fixture(scope="module")
def template(tokenizer: PreTrainedTokenizerBase) -> ChatTemplate:
    return ChatTemplate(tokenizer)


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> PreTrainedTokenizerBase:
    """A second, independent load of the model directory by transformers itself."""
    return AutoTokenizer.from_pretrained(default_model_dir)


def render(template: ChatTemplate, req: openai_pb2.ChatCompletionRequest) -> str:
    return template.render(chat_input(req, template.content_format))


def test_multi_turn_matches_transformers(template: ChatTemplate, reference) -> None:
    got = render(template, request(MULTI_TURN))
    assert got == reference.apply_chat_template(
        MULTI_TURN, tokenize=False, add_generation_prompt=True
    )
    assert got.endswith("<｜Assistant｜>")


def test_tool_definitions_match_transformers(template: ChatTemplate, reference) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    got = render(template, request(messages, tools=[WEATHER_TOOL], tool_choice="auto"))
    expected = reference.apply_chat_template(
        messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    assert got == expected


def test_a_schema_sent_as_struct_renders_the_same_values(template: ChatTemplate) -> None:
    """Without parameters_json (a Struct only) key order may differ, values may not."""
    req = request([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    req.tools[0].function.ClearField("parameters_json")
    req.tools[0].function.parameters.update(WEATHER_TOOL["function"]["parameters"])
    chat = chat_input(req, template.content_format)
    assert chat.tools == [WEATHER_TOOL]  # integral doubles are ints again: "minimum": 1


def test_tool_calls_and_tool_results_match_transformers(template: ChatTemplate, reference) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    got = render(template, request(messages, tools=[WEATHER_TOOL]))
    # transformers' convention: arguments as a mapping, as the frontend hands them over.
    hf_messages = copy.deepcopy(messages)
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2}
    expected = reference.apply_chat_template(
        hf_messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    assert got == expected
    assert "get_weather<｜tool▁sep｜>" in got and "sunny" in got


def test_continue_final_message_matches_transformers(template: ChatTemplate, reference) -> None:
    messages = [*MULTI_TURN, {"role": "assistant", "content": "Je vais"}]
    got = render(template, request(messages, continue_final_message=True))
    expected = reference.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert got == expected
    assert got.endswith("Je vais")


def test_content_parts_match_transformers(template: ChatTemplate, reference) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    messages = [{"role": "user", "content": parts}]
    assert template.content_format == "openai"  # this template prints lists of parts
    got = render(template, request(messages))
    assert got == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_add_generation_prompt_false_and_template_kwargs(template: ChatTemplate, reference) -> None:
    messages = MULTI_TURN[:2]
    got = render(
        template,
        request(messages, add_generation_prompt=False, chat_template_kwargs={"bos_token": "[B]"}),
    )
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, bos_token="[B]"
    )
    assert got == expected and got.startswith("[B]")


def test_rendered_text_encodes_to_transformers_ids(
    template: ChatTemplate, tokenizer: PreTrainedTokenizerBase, reference
) -> None:
    text = render(template, request(MULTI_TURN))
    assert not template.tokenizes_in_template
    assert tokenizer.encode(text, add_special_tokens=False) == reference.apply_chat_template(
        MULTI_TURN, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_a_tokenizer_that_splits_control_tokens_tokenizes_inside_the_template(
    default_model_dir: Path, reference
) -> None:
    splitting = AutoTokenizer.from_pretrained(default_model_dir, split_special_tokens=True)
    assert loses_control_tokens(splitting)
    template = ChatTemplate(splitting)
    assert template.tokenizes_in_template
    ids = template.tokenize(chat_input(request(MULTI_TURN), template.content_format))
    assert ids == splitting.apply_chat_template(
        MULTI_TURN, tokenize=True, add_generation_prompt=True, return_dict=False
    )


@pytest.mark.parametrize(
    ("messages", "fields", "field"),
    [
        ([], {}, "messages"),
        ([{"role": "wizard", "content": "x"}], {}, "messages"),
        (
            [{"role": "user", "content": [{"type": "image_url", "text": ""}]}],
            {},
            "messages",
        ),
        (
            [{"role": "user", "content": "x"}],
            {"continue_final_message": True},
            "continue_final_message",
        ),
        (
            [{"role": "assistant", "content": "x"}],
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        (
            [{"role": "user", "content": "x"}],
            {"chat_template_kwargs": {"tools": []}},
            "chat_template_kwargs",
        ),
        ([{"role": "user", "content": "x"}], {"tool_choice": "required"}, "tool_choice"),
        ([{"role": "user", "content": "x"}], {"tool_choice": "sometimes"}, "tool_choice"),
        (
            [{"role": "user", "content": "x"}],
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        ([{"role": "user", "content": "x"}], {"tools": [{"type": "retrieval"}]}, "tools"),
        ([{"role": "user", "content": "x"}], {"reasoning_effort": "max"}, "reasoning_effort"),
        (
            [{"role": "user", "content": "x"}],
            {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
            "reasoning_effort",
        ),
    ],
)
def test_invalid_chat_requests_name_the_field(
    template: ChatTemplate, messages: list, fields: dict, field: str
) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        render(template, request(messages, **fields))
    assert err.value.field == field


def test_reasoning_switches_reach_the_template(default_model_dir: Path) -> None:
    """reasoning_effort and chat_template_kwargs (enable_thinking, thinking) are template
    variables, the way Qwen3's and gpt-oss's templates read them."""
    tokenizer = load_tokenizer(default_model_dir)
    tokenizer.chat_template = (
        "{{ bos_token }}effort={{ reasoning_effort | default('unset') }} "
        "thinking={{ enable_thinking | default('unset') }}"
        "{% for m in messages %}|{{ m.content }}{% endfor %}"
    )
    template = ChatTemplate(tokenizer)
    messages = [{"role": "user", "content": "x"}]
    got = render(template, request(messages))
    assert got.endswith("effort=unset thinking=unset|x")
    fields = {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    got = render(template, request(messages, **fields))
    assert got.endswith("effort=low thinking=False|x")
    same = {"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "high"}}
    assert "effort=high" in render(template, request(messages, **same))
