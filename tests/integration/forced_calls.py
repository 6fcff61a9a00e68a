"""Forced tool calls checked through the openai SDK against a live stack: the tools, the
budget, and the check that test_tool_calls.py (with --tool-call-parser) and
test_tools_at_defaults.py (without one) both run.

The random default model never calls a tool by itself, so every call is the grammar's
doing. The schemas bound every string and number, and the grammar every run of whitespace
between JSON tokens (``JSON_MAX_WHITESPACE`` characters), so the random model (whose
strings rarely close: see tests/integration/test_structured_output.py, and which favours
whitespace) ends its calls within the budget.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai

from services.common.grammar import JSON_MAX_WHITESPACE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SEEDS = range(4)
# get_weather's longest call: about 13 places for whitespace (around each brace, key, colon,
# value and comma), each up to JSON_MAX_WHITESPACE characters, plus its ~60 characters of
# JSON and the call's tags, at one character or more a token.
BUDGET = 13 * JSON_MAX_WHITESPACE + 120


def ask(client: openai.OpenAI, model_id: str, seed: int, choice: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", BUDGET)
    return client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": f"Question {seed}: weather or time?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,
        seed=seed,
        temperature=0.8,
        **kwargs,
    )


def streamed_calls(chunks: list[Any]) -> tuple[list[dict[str, str]], str | None, str]:
    """(calls, finish_reason, content) as a client accumulates them from the deltas."""
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call: id, type, name
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def assert_valid(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def answers(client: openai.OpenAI, model_id: str, choice: Any, **kwargs: Any) -> list[Any]:
    """Per seed of SEEDS, the unary response then the stream's chunks, all asked at once:
    the batch decodes them together, and the shared scheduler is batch-invariant, so each
    request's tokens are what it would get alone (docs/batch-invariance.md)."""

    def one(seed: int, stream: bool) -> Any:
        if stream:
            return list(ask(client, model_id, seed, choice, stream=True, **kwargs))
        return ask(client, model_id, seed, choice, **kwargs)

    asks = [(seed, stream) for seed in SEEDS for stream in (False, True)]
    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(lambda a: one(*a), asks))


def check_forced_calls(client: openai.OpenAI, model_id: str, choice: Any, **kwargs: Any) -> None:
    """Over SEEDS: every unary response is valid calls to the allowed tools (one for a named
    choice or ``parallel_tool_calls: false``) with ``finish_reason: "tool_calls"``, and its
    stream adds up to the same calls."""
    named = choice != "required"
    allowed = {choice["function"]["name"]} if named else set(SCHEMAS)
    replies = answers(client, model_id, choice, **kwargs)
    for seed, unary, chunks in zip(SEEDS, replies[::2], replies[1::2], strict=True):
        message = unary.choices[0].message
        assert unary.choices[0].finish_reason == "tool_calls", message
        assert message.content is None and message.tool_calls
        if named or kwargs.get("parallel_tool_calls") is False:
            assert len(message.tool_calls) == 1
        for call in message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            assert_valid(call.function.name, call.function.arguments, allowed)

        calls, finish, content = streamed_calls(chunks)
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls
        ], seed
