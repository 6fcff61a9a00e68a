"""tool_choice: which parser reads the output, and the grammar that forces calls.

The grammar is checked with xgrammar itself: it accepts exactly the parser's syntax for
calls to the declared tools with arguments valid against their schemas, and what it
accepts reads back as those calls.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from services.common.errors import InvalidArgumentError
from services.common.grammar import structural_tag_ebnf
from services.frontend.chat.messages import ChatInput
from services.frontend.parsers.json_tool_calls import JsonArgumentsParser, JsonListParser
from services.frontend.parsers.tool_calls import TOOL_PARSERS, HermesParser, ToolParser
from services.frontend.serving.tool_choice import (
    ReasoningLead,
    ToolChoice,
    ToolGrammars,
    plan_tool_calls,
    structural_tag,
)
from services.frontend.validation.params import RequestedParams, params_from_openai
from tests.frontend.validation.test_structured_output import sampling

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
NOW: dict[str, Any] = {"type": "function", "function": {"name": "now"}}
PARSERS = sorted(set(TOOL_PARSERS.values()), key=lambda c: c.NAME)
# Without --tool-call-parser: "required" is a JSON list, a named choice its arguments.
REQUIRED_SYNTAXES = [*PARSERS, JsonListParser]
NAMED_SYNTAXES = [*PARSERS, JsonArgumentsParser]


def grammar(
    parser: type[ToolParser], choice: ToolChoice, lead: ReasoningLead = "none"
) -> xgrammar.Grammar:
    ebnf = structural_tag_ebnf(structural_tag(parser, [WEATHER, NOW], choice, lead))
    return xgrammar.Grammar.from_ebnf(ebnf)  # what the scheduler compiles


def calls_text(parser: type[ToolParser], *calls: tuple[str, str]) -> str:
    body = parser.SEPARATOR.join(parser.call_begin(n) + a + parser.CALL_END for n, a in calls)
    return parser.SECTION_BEGIN + body + parser.SECTION_END


PARIS = '{"city": "Paris", "unit": "c"}'


@pytest.mark.parametrize("parser", REQUIRED_SYNTAXES, ids=lambda p: p.NAME)
def test_required_accepts_one_or_more_valid_calls_and_nothing_else(
    parser: type[ToolParser],
) -> None:
    g = grammar(parser, ToolChoice("required"))
    good = [
        [("get_weather", PARIS)],
        [("now", "{}"), ("get_weather", '{ "city" : "Oslo" ,"unit":"f"}')],
    ]
    for calls in good:
        text = calls_text(parser, *calls)
        assert _is_grammar_accept_string(g, text), text
        read = parser().parse(text)
        assert read.content == "" and [(c.name, c.arguments) for c in read.calls] == calls
    bad = [
        "",
        "Sure, here is the weather.",
        calls_text(parser, ("get_time", "{}")),  # not a declared tool
        calls_text(parser, ("get_weather", '{"city": "Paris"}')),  # missing "unit"
        calls_text(parser, ("get_weather", '{"city": "Paris", "unit": "k"}')),
        calls_text(parser, ("get_weather", '{"city": "Paris", "unit": "c", "x": 1}')),
        calls_text(parser, ("now", '{"a": 1}')),  # no parameters: only {}
    ]
    for text in bad:
        assert not _is_grammar_accept_string(g, text), text


@pytest.mark.parametrize("parser", NAMED_SYNTAXES, ids=lambda p: p.NAME)
def test_a_named_choice_is_exactly_one_call_to_it(parser: type[ToolParser]) -> None:
    g = grammar(parser, ToolChoice("named", "get_weather"))
    assert _is_grammar_accept_string(g, calls_text(parser, ("get_weather", PARIS)))
    assert not _is_grammar_accept_string(g, calls_text(parser, ("now", "{}")))
    two = calls_text(parser, ("get_weather", PARIS), ("get_weather", PARIS))
    assert not _is_grammar_accept_string(g, two)


@pytest.mark.parametrize("parser", [HermesParser, JsonListParser], ids=lambda p: p.NAME)
def test_reasoning_may_or_must_come_first(parser: type[ToolParser]) -> None:
    call = calls_text(parser, ("now", "{}"))
    required = grammar(parser, ToolChoice("required"), "required")
    assert _is_grammar_accept_string(required, "Let me see.</think>\n\n" + call)
    assert not _is_grammar_accept_string(required, call)
    optional = grammar(parser, ToolChoice("required"), "optional")
    assert _is_grammar_accept_string(optional, "<think>Hmm.</think>\n" + call)
    assert _is_grammar_accept_string(optional, call)


def test_tool_schemas_keep_their_key_order_in_the_grammar() -> None:
    """Properties are generated in the schema's order, the client's order."""
    g = grammar(HermesParser, ToolChoice("named", "get_weather"))
    swapped = calls_text(HermesParser, ("get_weather", '{"unit": "c", "city": "Paris"}'))
    assert not _is_grammar_accept_string(g, swapped)


def chat(tools: list[dict[str, Any]], choice: Any = None) -> ChatInput:
    kwargs = {} if choice is None else {"tool_choice": choice}
    return ChatInput([{"role": "user", "content": "x"}], tools or None, kwargs=kwargs)


async def plan(
    chat_input: ChatInput, parser: type[ToolParser] | None, **fields: Any
) -> tuple[type[ToolParser] | None, RequestedParams]:
    requested = params_from_openai(sampling(**fields))
    found = await plan_tool_calls(chat_input, requested, parser, "none", ToolGrammars())
    return found, requested


async def test_none_and_auto_read_without_constraining() -> None:
    for choice, expected in (("none", None), (None, HermesParser), ("auto", HermesParser)):
        found, requested = await plan(chat([WEATHER], choice), HermesParser)
        assert found is expected and requested.params.grammar is None
    found, _ = await plan(chat([], None), HermesParser)
    assert found is None  # no tools: nothing to call
    found, _ = await plan(chat([WEATHER], None), None)
    assert found is None  # tools, no choice, no parser on the server: content, as before


async def test_auto_without_a_parser_is_refused_naming_the_flag() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        await plan(chat([WEATHER], "auto"), None)
    assert info.value.field == "tool_choice" and "--tool-call-parser" in info.value.message


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_a_forced_choice_sets_the_grammar(choice: Any) -> None:
    found, requested = await plan(chat([WEATHER, NOW], choice), HermesParser)
    spec = requested.params.grammar
    assert found is HermesParser and spec is not None and spec.kind == "ebnf"
    assert requested.aliases["ebnf"] == "tools"
    assert _is_grammar_accept_string(
        xgrammar.Grammar.from_ebnf(spec.text), calls_text(HermesParser, ("get_weather", PARIS))
    )


@pytest.mark.parametrize(
    ("choice", "script"),
    [
        ("required", '[{"name": "get_weather", "arguments": ' + PARIS + "}]"),
        ({"type": "function", "function": {"name": "get_weather"}}, PARIS),
    ],
)
async def test_without_a_parser_a_forced_choice_is_plain_json(choice: Any, script: str) -> None:
    found, requested = await plan(chat([WEATHER, NOW], choice), None)
    spec = requested.params.grammar
    assert found is not None and spec is not None and spec.kind == "ebnf"
    assert _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(spec.text), script)
    [call] = found().parse(script).calls
    assert (call.name, call.arguments) == ("get_weather", PARIS)


@pytest.mark.parametrize(
    ("parser", "fields", "tools", "field", "message"),
    [
        (None, {"responseFormat": {"type": "json_object"}}, [WEATHER], "tool_choice", "response"),
        (
            HermesParser,
            {"responseFormat": {"type": "json_object"}},
            [WEATHER],
            "tool_choice",
            "response_format",
        ),
        (
            HermesParser,
            {},
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tools",
            "no grammar",
        ),
    ],
)
async def test_a_forced_choice_it_cannot_honour_is_refused_by_name(
    parser: type[ToolParser] | None,
    fields: dict[str, Any],
    tools: list[dict[str, Any]],
    field: str,
    message: str,
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        await plan(chat(tools, "required"), parser, **fields)
    assert info.value.field == field and message in info.value.message


def test_the_structural_tag_is_json_and_names_every_tool() -> None:
    tag = json.loads(structural_tag(HermesParser, [WEATHER, NOW], ToolChoice("required"), "none"))
    tags = tag["format"]["elements"][0]["tags"]
    assert [t["begin"] for t in tags] == [
        HermesParser.call_begin("get_weather"),
        HermesParser.call_begin("now"),
    ]


@pytest.mark.parametrize("parser", REQUIRED_SYNTAXES, ids=lambda p: p.NAME)
def test_required_without_parallel_calls_is_exactly_one_call(parser: type[ToolParser]) -> None:
    g = grammar(parser, ToolChoice("required", is_parallel=False))
    assert _is_grammar_accept_string(g, calls_text(parser, ("now", "{}")))
    assert not _is_grammar_accept_string(g, calls_text(parser, ("now", "{}"), ("now", "{}")))


async def test_one_call_under_auto_is_refused_by_name() -> None:
    chat_input = chat([WEATHER], "auto")
    chat_input.parallel_tool_calls = False
    with pytest.raises(InvalidArgumentError) as info:
        await plan(chat_input, HermesParser)
    assert info.value.field == "parallel_tool_calls"
