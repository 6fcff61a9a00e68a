"""Tool-call parsers on scripted texts: the one-shot result, and the same result from the
streaming interface however the text is cut (at every point, at every pair of points, and
one character at a time), with each call's id and name before its arguments."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator

import pytest

from services.frontend.parsers.tool_calls import (
    TOOL_PARSERS,
    DeepSeekV31Parser,
    HermesParser,
    Llama3JsonParser,
    ParsedText,
    ToolCallDelta,
    ToolParser,
    held_prefix,
    merge_calls,
    tool_parser_class,
)

Calls = list[tuple[str, str]]  # (name, arguments)


def ids() -> Callable[[], str]:
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def run(cls: type[ToolParser], pieces: list[str]) -> tuple[ParsedText, list[ToolCallDelta]]:
    """Feed the pieces, finish; the merged result and the raw delta sequence."""
    parser = cls(ids())
    out = ParsedText()
    for piece in pieces:
        out.extend(parser.feed(piece))
    out.extend(parser.finish())
    deltas = out.calls
    out.calls = merge_calls(deltas)
    return out, deltas


def cuts(text: str) -> Iterator[list[str]]:
    """The text cut at every point, at every pair of points, and into characters."""
    n = len(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, n), 2):
        yield [text[:i], text[i:j], text[j:]]
    yield list(text)


def check(cls: type[ToolParser], text: str, content: str, calls: Calls) -> None:
    one = cls(ids()).parse(text)
    assert one.content == content
    assert [(c.name, c.arguments) for c in one.calls] == calls
    assert [c.id for c in one.calls] == [f"call_{i}" for i in range(len(calls))]
    for pieces in cuts(text):
        got, deltas = run(cls, pieces)
        assert got == one, pieces
        assert_name_first(deltas)


def assert_name_first(deltas: list[ToolCallDelta]) -> None:
    """Each call opens with one delta carrying id and name; calls come in index order."""
    seen: set[int] = set()
    for d in deltas:
        if d.index not in seen:
            assert d.id and d.name and d.index == len(seen)
            seen.add(d.index)
        else:
            assert not d.id and not d.name and d.arguments


WEATHER_ARGS = '{"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}'

HERMES_CASES = [
    (  # content, then two calls; separators are not content
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        + WEATHER_ARGS
        + '}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n',
        "Let me check.",
        [("get_weather", WEATHER_ARGS), ("now", "{}")],
    ),
    (  # the model's own spacing inside the arguments is kept as written
        '<tool_call>{"name":"f","arguments":{ "a" :1 }}</tool_call>',
        "",
        [("f", '{ "a" :1 }')],
    ),
    ("a < b <tool and <tool_cal done  ", "a < b <tool and <tool_cal done  ", []),
    (  # arguments before the name: read whole, arguments re-serialised
        '<tool_call>\n{"arguments": {"x": [1, 2]}, "name": "g"}\n</tool_call>',
        "",
        [("g", '{"x": [1, 2]}')],
    ),
    (  # not a call: the text stays content, tags included
        "<tool_call>\nnot json\n</tool_call> after",
        "<tool_call>\nnot json\n</tool_call> after",
        [],
    ),
    (  # cut off inside the arguments: the call keeps what it had
        'x <tool_call>\n{"name": "f", "arguments": {"a": "b',
        "x",
        [("f", '{"a": "b')],
    ),
    ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
    (  # text after a call is content again
        '<tool_call>{"name": "f", "parameters": {}}</tool_call>\n\nDone.',
        "Done.",
        [("f", "{}")],
    ),
    ('<tool_call>\n{"name": "caf\\u00e9", "arguments": {}}\n</tool_call>', "", [("café", "{}")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes(text: str, content: str, calls: Calls) -> None:
    check(HermesParser, text, content, calls)


LLAMA3_CASES = [
    (
        '<|python_tag|>{"name": "get_weather", "parameters": '
        + WEATHER_ARGS
        + '}; {"name": "now", "arguments": {}}',
        "",
        [("get_weather", WEATHER_ARGS), ("now", "{}")],
    ),
    (' \n{"name": "f", "parameters": {"a": 1}} and more', "and more", [("f", '{"a": 1}')]),
    ('{"parameters": {"b": 2}, "name": "g"}', "", [("g", '{"b": 2}')]),
    ('{"answer": 42} is JSON, not a call', '{"answer": 42} is JSON, not a call', []),
    ('Hi {"name": "f", "parameters": {}}', 'Hi {"name": "f", "parameters": {}}', []),
    ('{"name": "f", "parameters": {"a": [', "", [("f", '{"a": [')]),
    ('{"name": "f"', '{"name": "f"', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3_CASES)
def test_llama3_json(text: str, content: str, calls: Calls) -> None:
    check(Llama3JsonParser, text, content, calls)


B, E = DeepSeekV31Parser.SECTION_BEGIN, DeepSeekV31Parser.SECTION_END
CB, SEP, CE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", DeepSeekV31Parser.CALL_END

DEEPSEEK_CASES = [
    (
        f"Checking.{B}{CB}get_weather{SEP}{WEATHER_ARGS}{CE}\n{CB}now{SEP}{{}}{CE}{E}",
        "Checking.",
        [("get_weather", WEATHER_ARGS), ("now", "{}")],
    ),
    (f"<｜tool▁calls and {B[:-1]}", f"<｜tool▁calls and {B[:-1]}", []),
    (f'{B}{CB}f{SEP}{{"a": 1', "", [("f", '{"a": 1')]),
    (f"{B}{CB}f{SEP}{{}}{CE}{E} Done.", "Done.", [("f", "{}")]),
    (f"{B}garbage", "garbage", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), DEEPSEEK_CASES)
def test_deepseek_v31(text: str, content: str, calls: Calls) -> None:
    check(DeepSeekV31Parser, text, content, calls)


@pytest.mark.parametrize("cls", sorted(set(TOOL_PARSERS.values()), key=lambda c: c.NAME))
def test_a_call_written_by_the_format_reads_back(cls: type[ToolParser]) -> None:
    """What the grammar forces (call_begin, arguments, CALL_END, joined by SEPARATOR in a
    section) is what the parser reads: the contract serving/tool_choice.py relies on."""
    args = {"city": "Paris", "note": 'a } and a "quote"'}
    one = cls.call_begin("get_weather") + json.dumps(args) + cls.CALL_END
    two = cls.call_begin("now") + "{}" + cls.CALL_END
    text = cls.SECTION_BEGIN + one + cls.SEPARATOR + two + cls.SECTION_END
    check(cls, text, "", [("get_weather", json.dumps(args)), ("now", "{}")])


@pytest.mark.parametrize("cls", sorted(set(TOOL_PARSERS.values()), key=lambda c: c.NAME))
def test_plain_text_passes_through_unchanged(cls: type[ToolParser]) -> None:
    text = "Plain answer: 3 < 4, {x} and <b>bold</b>.\n\n"
    check(cls, text, text, [])


def test_held_prefix() -> None:
    assert held_prefix("abc <tool", "<tool_call>") == 5
    assert held_prefix("abc", "<tool_call>") == 0
    assert held_prefix("<tool_call>", "<tool_call>") == 0  # a whole marker is found, not held


def test_registry_names_the_choices() -> None:
    assert tool_parser_class("qwen") is HermesParser
    with pytest.raises(ValueError, match="llama3_json"):
        tool_parser_class("nope")
