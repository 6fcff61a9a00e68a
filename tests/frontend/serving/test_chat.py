"""ChatServing's OpenAI assembly with reasoning and tool-call parsers, on scripted output.

A scripted manager stands in for the schedulers and the detokenizer: it records the
requests it was given and plays a fixed text back one real token per row, so tags arrive
cut wherever the default model's tokenizer cuts them. Unary and streamed responses are
compared field by field.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import xgrammar
from google.protobuf import json_format
from tokenline.v1 import common_pb2, detokenizer_pb2, openai_pb2
from transformers import PreTrainedTokenizerBase
from xgrammar.testing import _is_grammar_accept_string

from services.common.errors import InvalidArgumentError
from services.frontend.chat.template import ChatTemplate
from services.frontend.dispatch.batch_tokenizer import DynamicBatchTokenizer
from services.frontend.dispatch.tokenizer_manager import TokenizedRequest
from services.frontend.parsers.reasoning import (
    DeepSeekR1Parser,
    Qwen3Parser,
    ReasoningParser,
)
from services.frontend.parsers.tool_calls import DeepSeekV31Parser, HermesParser, ToolParser
from services.frontend.serving.base import ServingContext
from services.frontend.serving.chat import ChatServing
from services.frontend.validation.limits import ModelLimits

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_ARGS = '{"city": "Paris"}'
HERMES_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {CALL_ARGS}}}\n</tool_call>'


class ScriptedManager:
    """Plays ``script`` back for every choice, one token per row."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, script: str, finish: int) -> None:
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(script, add_special_tokens=False)
        self.finish = finish
        self.requests: list[TokenizedRequest] = []
        self.router = SimpleNamespace(context_length=lambda: 0, runs_pooling_only=lambda: False)
        self.num_rids = 0

    def new_rid(self) -> str:
        self.num_rids += 1
        return f"rid-{self.num_rids}"

    @contextlib.asynccontextmanager
    async def open(
        self, requests: list[TokenizedRequest]
    ) -> AsyncIterator[AsyncIterator[tuple[int, detokenizer_pb2.StrRow]]]:
        self.requests += requests
        yield self._rows(requests)

    async def generate(
        self, requests: list[TokenizedRequest]
    ) -> AsyncIterator[tuple[int, detokenizer_pb2.StrRow]]:
        async with self.open(requests) as rows:
            async for item in rows:
                yield item

    async def _rows(
        self, requests: list[TokenizedRequest]
    ) -> AsyncIterator[tuple[int, detokenizer_pb2.StrRow]]:
        for index, req in enumerate(requests):
            sent = ""
            for k, token_id in enumerate(self.ids):
                text = self.tokenizer.decode(self.ids[: k + 1])
                row = detokenizer_pb2.StrRow(rid=req.rid, text=text[len(sent) :])
                row.output_ids.append(token_id)
                sent = text
                if k == len(self.ids) - 1:
                    row.finish_reason.kind = self.finish
                    row.usage.prompt_tokens = len(req.input_ids)
                    row.usage.completion_tokens = len(self.ids)
                yield index, row


@pytest.fixture
async def make_serving(tokenizer: PreTrainedTokenizerBase):
    batchers: list[DynamicBatchTokenizer] = []

    def make(
        script: str,
        tools: type[ToolParser] | None = None,
        reasoning: type[ReasoningParser] | None = None,
        finish: int = common_pb2.FinishReason.KIND_STOP,
    ) -> ChatServing:
        batchers.append(DynamicBatchTokenizer(tokenizer))
        ctx = ServingContext(
            tokenizer=tokenizer,
            batcher=batchers[-1],
            manager=ScriptedManager(tokenizer, script, finish),  # type: ignore[arg-type]
            limits=ModelLimits(
                vocab_size=len(tokenizer), context_length=4096, default_max_tokens=64
            ),
            model_name="tiny",
            chat_template=ChatTemplate(tokenizer),
            tool_parser=tools,
            reasoning_parser=reasoning,
        )
        return ChatServing(ctx)

    yield make
    for batcher in batchers:
        await batcher.close()


def chat(**fields: Any) -> openai_pb2.ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    body["tools"] = copy.deepcopy(body.get("tools", []))
    for tool in body["tools"]:
        tool["function"]["parametersJson"] = json.dumps(tool["function"].pop("parameters"))
    return json_format.ParseDict(body, openai_pb2.ChatCompletionRequest())


async def both(
    serving: ChatServing, **fields: Any
) -> tuple[openai_pb2.ChatCompletion, list[openai_pb2.ChatCompletionChunk]]:
    unary = await serving.complete(chat(**fields))
    fields = {**fields, "stream": True, "stream_options": {"include_usage": True}}
    chunks = [c async for c in serving.stream(chat(**fields))]
    return unary, chunks


def joined(chunks: list[openai_pb2.ChatCompletionChunk]) -> dict[str, Any]:
    """What an OpenAI client accumulates from the deltas of choice 0."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content
            out["reasoning"] += delta.reasoning_content
            for call in delta.tool_calls:
                entry = out["calls"].setdefault(call.index, {"id": "", "name": "", "args": ""})
                if call.id:
                    assert not entry["id"], "a call's id and name come once, first"
                    assert not entry["args"]
                    entry["id"], entry["name"] = call.id, call.function.name
                entry["args"] += call.function.arguments
            if choice.HasField("finish_reason"):
                out["finish"] = choice.finish_reason
    return out


async def test_reasoning_then_a_call_unary_and_streamed(make_serving) -> None:
    script = "The user wants weather.</think>\n\n" + HERMES_CALL
    serving = make_serving(script, HermesParser, DeepSeekR1Parser)
    unary, chunks = await both(serving, tools=[WEATHER])
    message = unary.choices[0].message
    assert message.reasoning_content == "The user wants weather."
    assert not message.HasField("content")  # null beside tool calls
    [call] = message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", CALL_ARGS)
    assert call.id.startswith("call_") and call.type == "function"
    assert unary.choices[0].finish_reason == "tool_calls"
    reasoning_ids = serving.tokenizer.encode("The user wants weather.</think>")
    assert unary.usage.completion_tokens_details.reasoning_tokens == len(reasoning_ids)

    streamed = joined(chunks)
    assert streamed["reasoning"] == message.reasoning_content
    assert streamed["content"] == ""
    assert [(c["name"], c["args"]) for c in streamed["calls"].values()] == [
        ("get_weather", CALL_ARGS)
    ]
    assert streamed["finish"] == "tool_calls"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == len(reasoning_ids)


async def test_the_default_models_syntax_is_read_in_a_stream(make_serving) -> None:
    script = (
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        + CALL_ARGS
        + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    unary, chunks = await both(make_serving(script, DeepSeekV31Parser), tools=[WEATHER])
    message = unary.choices[0].message
    assert message.content == "Sure." and message.tool_calls[0].function.arguments == CALL_ARGS
    streamed = joined(chunks)
    assert streamed["content"] == "Sure." and streamed["calls"][0]["args"] == CALL_ARGS
    assert not unary.usage.HasField("completion_tokens_details")  # no reasoning parser


async def test_a_call_cut_off_by_the_length_limit_finishes_with_length(make_serving) -> None:
    script = HERMES_CALL[: HERMES_CALL.index("Paris") + 3]
    serving = make_serving(script, HermesParser, finish=common_pb2.FinishReason.KIND_LENGTH)
    unary, chunks = await both(serving, tools=[WEATHER])
    assert unary.choices[0].finish_reason == "length" and joined(chunks)["finish"] == "length"
    assert unary.choices[0].message.tool_calls[0].function.arguments == '{"city": "Par'
    assert joined(chunks)["calls"][0]["args"] == '{"city": "Par'


@pytest.mark.parametrize(
    ("fields", "parser"),
    [
        ({}, HermesParser),  # no tools in the request
        ({"tools": [WEATHER], "tool_choice": "none"}, HermesParser),
        ({"tools": [WEATHER]}, None),  # no --tool-call-parser
    ],
)
async def test_without_parsing_everything_is_content(
    make_serving, fields: dict[str, Any], parser: type[ToolParser] | None
) -> None:
    script = "<think>x</think>" + HERMES_CALL
    unary, chunks = await both(make_serving(script, parser), **fields)
    message = unary.choices[0].message
    assert message.content == script and not message.tool_calls
    assert not message.HasField("reasoning_content")
    assert joined(chunks)["content"] == script and unary.choices[0].finish_reason == "stop"


async def test_qwen3_without_thinking_is_all_content(make_serving) -> None:
    serving = make_serving("The answer is 4.", reasoning=Qwen3Parser)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    unary, chunks = await both(serving, **kwargs)
    assert unary.choices[0].message.content == "The answer is 4."
    assert not unary.choices[0].message.HasField("reasoning_content")
    assert unary.usage.completion_tokens_details.reasoning_tokens == 0
    assert joined(chunks)["reasoning"] == ""


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_a_forced_choice_dispatches_its_grammar(make_serving, choice: Any) -> None:
    serving = make_serving(HERMES_CALL, HermesParser)
    unary = await serving.complete(chat(tools=[WEATHER], tool_choice=choice))
    [req] = serving.manager.requests
    assert req.params.ebnf is not None and "get_weather" in req.params.ebnf
    assert unary.choices[0].finish_reason == "tool_calls"


JSON_CALLS = (
    f'[{{"name": "get_weather", "arguments": {CALL_ARGS}}}, {{"name": "now", "arguments": {{}}}}]'
)
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("choice", "script", "expected"),
    [
        ("required", JSON_CALLS, [("get_weather", CALL_ARGS), ("now", "{}")]),
        ({"type": "function", "function": {"name": "get_weather"}}, CALL_ARGS, None),
    ],
)
async def test_a_forced_choice_without_a_parser_reads_its_json_back(
    make_serving, choice: Any, script: str, expected: list[tuple[str, str]] | None
) -> None:
    """No --tool-call-parser: the grammar forces plain JSON (a list of calls, or the named
    function's arguments), which comes back as tool_calls, unary and streamed alike."""
    expected = expected or [("get_weather", CALL_ARGS)]
    serving = make_serving(script)
    unary, chunks = await both(serving, tools=[WEATHER, NOW], tool_choice=choice)
    [req, _] = serving.manager.requests
    assert req.params.ebnf is not None  # the grammar forces exactly what is read back
    assert _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(req.params.ebnf), script)
    message = unary.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == expected
    assert not message.HasField("content") and unary.choices[0].finish_reason == "tool_calls"
    streamed = joined(chunks)
    assert [(c["name"], c["args"]) for c in streamed["calls"].values()] == expected
    assert streamed["content"] == "" and streamed["finish"] == "tool_calls"


async def test_auto_without_a_parser_is_refused_naming_the_flag(make_serving) -> None:
    serving = make_serving(HERMES_CALL)
    with pytest.raises(InvalidArgumentError) as info:
        await serving.complete(chat(tools=[WEATHER], tool_choice="auto"))
    assert info.value.field == "tool_choice" and "--tool-call-parser" in info.value.message
    assert not serving.manager.requests
