"""The plain JSON a forced tool_choice writes without --tool-call-parser, read back: the
one-shot result, and the same from the streaming interface however the text is cut
(tests/frontend/parsers/test_tool_calls.py's cuts), each call's id and name first."""

from __future__ import annotations

import functools
import json

import pytest

from services.frontend.parsers.json_tool_calls import JsonArgumentsParser, JsonListParser
from tests.frontend.parsers.test_tool_calls import WEATHER_ARGS, Calls, check

LIST_CASES = [
    ('[{"name": "now", "arguments": {}}]', "", [("now", "{}")]),
    (
        f'[{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}, '
        '{"name": "now", "arguments": {}}]',
        "",
        [("get_weather", WEATHER_ARGS), ("now", "{}")],
    ),
    # Whitespace the JSON grammar allows between tokens, and a name with an escape.
    (' [ {"name" : "a\\"b" ,"arguments":{ "x": 1 }} ] ', "", [('a"b', '{ "x": 1 }')]),
    ("Not a list of calls.", "Not a list of calls.", []),
    ('{"name": "now", "arguments": {}}', '{"name": "now", "arguments": {}}', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LIST_CASES)
def test_a_list_of_calls(text: str, content: str, calls: Calls) -> None:
    check(JsonListParser, text, content, calls)  # type: ignore[arg-type]


def test_a_list_written_by_its_grammars_syntax_reads_back() -> None:
    """What serving/tool_choice.py forces (SECTION_BEGIN, call_begin + arguments + CALL_END
    joined by SEPARATOR, SECTION_END) is what the parser reads."""
    p = JsonListParser
    args = json.dumps({"city": "Paris", "note": 'a ] } and a "quote"'})
    calls = [
        p.call_begin(name) + a + p.CALL_END for name, a in (("get_weather", args), ("now", "{}"))
    ]
    text = p.SECTION_BEGIN + p.SEPARATOR.join(calls) + p.SECTION_END
    json.loads(text)  # plain JSON, as documented
    check(p, text, "", [("get_weather", args), ("now", "{}")])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (WEATHER_ARGS, "", [("get_weather", WEATHER_ARGS)]),
        ("\n " + WEATHER_ARGS, "", [("get_weather", WEATHER_ARGS)]),
        ("plain text", "plain text", []),
    ],
)
def test_the_named_functions_arguments(text: str, content: str, calls: Calls) -> None:
    parser = functools.partial(JsonArgumentsParser, "get_weather")
    check(parser, text, content, calls)  # type: ignore[arg-type]


def test_a_cut_off_list_keeps_what_came() -> None:
    """max_tokens reached mid-call: the calls so far, the last one's arguments a prefix."""
    text = '[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"ci'
    got = JsonListParser().parse(text)
    assert [(c.name, c.arguments) for c in got.calls] == [("now", "{}"), ("get_weather", '{"ci')]
    assert got.content == ""
