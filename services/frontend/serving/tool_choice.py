"""tool_choice: whether a chat's output is read for tool calls, and the grammar forcing them.

| tool_choice | the output is read for calls | decoding |
|---|---|---|
| ``"none"``, or no tools | no: all of it is content | free |
| ``"auto"`` | by ``--tool-call-parser`` (refused without one) | free |
| no tool_choice, with tools | by the parser when the server has one, else all content | free |
| ``"required"`` | by the parser, or as a JSON list | one or more calls to the request's tools |
| a named function N | by the parser, or as N's arguments | exactly one call to N |

A forced choice is a grammar in the syntax of whatever reads the output (xgrammar
structural tags: a call's opening text, its parameters' JSON Schema, its closing text), so
what decoding forces is exactly what is read back, each call's arguments valid against its
tool's schema (strict: no unlisted properties). With ``--tool-call-parser`` that is the
model's own syntax; without one, the plain JSON of ``parsers/json_tool_calls.py``. It
travels to the scheduler as EBNF (``SamplingParams.ebnf``) like any other grammar, so
another grammar in the same request (``response_format``, ...) is refused. With a reasoning
parser the grammar lets the reasoning come first: up to ``</think>`` when the output starts
inside the block, an optional ``<think>…</think>`` otherwise.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from services.common.errors import InvalidArgumentError
from services.common.grammar import JSON_MAX_WHITESPACE, GrammarError, structural_tag_ebnf
from services.frontend.chat.messages import ChatInput
from services.frontend.parsers.json_tool_calls import JsonArgumentsParser, JsonListParser
from services.frontend.parsers.reasoning import THINK_END, THINK_START
from services.frontend.parsers.tool_calls import ToolParser
from services.frontend.validation.params import RequestedParams
from services.frontend.validation.structured_output import BuildCache

Mode = Literal["none", "auto", "required", "named"]
# Makes the parser that reads one choice's output.
ToolReader = Callable[[], ToolParser]
# Reasoning before the calls: none, an optional <think> block, or up to </think>.
ReasoningLead = Literal["none", "optional", "required"]
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_WHITESPACE = {"type": "regex", "pattern": r"\s{0,4}"}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Mode
    name: str = ""  # the function a named choice forces
    is_explicit: bool = False  # the request named its tool_choice
    is_parallel: bool = True  # parallel_tool_calls: false holds "required" to one call

    @classmethod
    def of(cls, chat: ChatInput) -> ToolChoice:
        """From a validated ChatInput (``chat_messages.tool_choice_value`` checked it)."""
        value, parallel = chat.kwargs.get("tool_choice"), chat.parallel_tool_calls
        if not chat.tools or value == "none":
            return cls("none")
        if value is None or value == "auto":
            return cls("auto", is_explicit=value is not None, is_parallel=parallel)
        if value == "required":
            return cls("required", is_parallel=parallel)
        return cls("named", value["function"]["name"])

    @property
    def is_forced(self) -> bool:
        return self.mode in ("required", "named")


class ToolGrammars:
    """Forced tool calls as EBNF, built on a worker thread once per distinct grammar."""

    def __init__(self, max_entries: int = 256) -> None:
        self._cache = BuildCache(_ebnf_or_error, max_entries, "tool-grammar")

    async def ebnf(self, structural_tag: str) -> str:
        ebnf, error = await self._cache.get(structural_tag)
        if error is not None:
            raise InvalidArgumentError(f"no grammar for these tools: {error}", field="tools")
        return ebnf


async def plan_tool_calls(
    chat: ChatInput,
    requested: RequestedParams,
    parser: type[ToolParser] | None,
    lead: ReasoningLead,
    grammars: ToolGrammars,
) -> ToolReader | None:
    """What reads this request's output for calls (None: all of it is content). A forced
    choice also sets the request's grammar; one it cannot honour is refused by name."""
    choice = ToolChoice.of(chat)
    if choice.mode == "none":
        return None
    if not choice.is_forced:
        if not choice.is_parallel:
            raise InvalidArgumentError(
                "false needs tool_choice 'required' or a named function (under 'auto' "
                "nothing holds the model to one call)",
                field="parallel_tool_calls",
            )
        if parser is None and choice.is_explicit:
            raise InvalidArgumentError(
                "'auto' needs the server to run a --tool-call-parser (the model's call "
                "syntax); 'required' and a named function work without one",
                field="tool_choice",
            )
        return parser
    spec = requested.params.grammar
    if spec is not None:
        other = requested.aliases.get(spec.kind, spec.kind)
        raise InvalidArgumentError(f"cannot be combined with {other}", field="tool_choice")
    assert chat.tools is not None  # ToolChoice.of: no tools is "none"
    syntax, reader = _forced_reader(parser, choice)
    requested.params.ebnf = await grammars.ebnf(structural_tag(syntax, chat.tools, choice, lead))
    requested.aliases["ebnf"] = "tools"
    return reader


def _forced_reader(
    parser: type[ToolParser] | None, choice: ToolChoice
) -> tuple[type[ToolParser], ToolReader]:
    """The syntax a forced choice's grammar writes, and what reads it back: the server's
    parser, else plain JSON (a list of calls, or the named function's arguments)."""
    if parser is not None:
        return parser, parser
    if choice.mode == "named":
        return JsonArgumentsParser, functools.partial(JsonArgumentsParser, choice.name)
    return JsonListParser, JsonListParser


def structural_tag(
    parser: type[ToolParser], tools: list[dict[str, Any]], choice: ToolChoice, lead: ReasoningLead
) -> str:
    """The forced output as an xgrammar structural tag (JSON text; also the cache key)."""
    functions = [t["function"] for t in tools]
    if choice.mode == "named":
        calls = _call_tag(parser, next(f for f in functions if f["name"] == choice.name))
    else:
        calls = {
            "type": "tags_with_separator",
            "tags": [_call_tag(parser, f) for f in functions],
            "separator": parser.SEPARATOR,
            "at_least_one": True,
            "stop_after_first": not choice.is_parallel,
        }
    elements = [calls]
    if parser.SECTION_BEGIN:
        elements = [_const(parser.SECTION_BEGIN), calls, _const(parser.SECTION_END)]
    if lead == "required":
        elements = [_thinking(""), _WHITESPACE, *elements]
    elif lead == "optional":
        block = {"type": "sequence", "elements": [_thinking(THINK_START), _WHITESPACE]}
        elements = [{"type": "optional", "content": block}, *elements]
    fmt = {"type": "sequence", "elements": elements}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def _call_tag(parser: type[ToolParser], function: dict[str, Any]) -> dict[str, Any]:
    # No parameters (or an empty schema, which would allow any JSON value): an empty object.
    schema = function.get("parameters") or NO_PARAMETERS
    arguments = {
        "type": "json_schema",
        "json_schema": schema,
        "max_whitespace_cnt": JSON_MAX_WHITESPACE,
    }
    begin = parser.call_begin(function["name"])
    if not begin and not parser.CALL_END:  # a syntax that is the arguments alone
        return arguments
    return {"type": "tag", "begin": begin, "content": arguments, "end": parser.CALL_END}


def _thinking(begin: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": THINK_END}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _ebnf_or_error(structural_tag: str) -> tuple[str, str | None]:
    try:
        return structural_tag_ebnf(structural_tag), None
    except GrammarError as exc:
        return "", str(exc)
