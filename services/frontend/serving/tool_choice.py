"""tool_choice: whether a chat's output is read for tool calls, and the grammar forcing them.

| tool_choice | the output is read for calls | decoding |
|---|---|---|
| ``"none"``, or no tools | no: all of it is content | free |
| ``"auto"`` (the default with tools) | by ``--tool-call-parser``, when the server has one | free |
| ``"required"`` | by the parser | one or more calls to the request's tools |
| ``{"type": "function", "function": {"name": N}}`` | by the parser | exactly one call to N |

The last two need a parser: the grammar is written in its syntax (xgrammar structural
tags: a call's opening text, its parameters' JSON Schema, its closing text), so what
decoding forces is exactly what the parser reads, each call's arguments valid against its
tool's schema (strict: no unlisted properties). It travels to the scheduler as EBNF
(``SamplingParams.ebnf``) like any other grammar, so another grammar in the same request
(``response_format``, ...) is refused. With a reasoning parser the grammar lets the
reasoning come first: up to ``</think>`` when the output starts inside the block, an
optional ``<think>…</think>`` otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from services.common.errors import InvalidArgumentError
from services.common.grammar import JSON_MAX_WHITESPACE, GrammarError, structural_tag_ebnf
from services.frontend.chat.messages import ChatInput
from services.frontend.parsers.reasoning import THINK_END, THINK_START
from services.frontend.parsers.tool_calls import ToolParser
from services.frontend.validation.params import RequestedParams
from services.frontend.validation.structured_output import BuildCache

Mode = Literal["none", "auto", "required", "named"]
# Reasoning before the calls: none, an optional <think> block, or up to </think>.
ReasoningLead = Literal["none", "optional", "required"]
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_WHITESPACE = {"type": "regex", "pattern": r"\s{0,4}"}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Mode
    name: str = ""  # the function a named choice forces

    @classmethod
    def of(cls, chat: ChatInput) -> ToolChoice:
        """From a validated ChatInput (``chat_messages.tool_choice_value`` checked it)."""
        value = chat.kwargs.get("tool_choice")
        if not chat.tools or value == "none":
            return cls("none")
        if value is None or value == "auto":
            return cls("auto")
        if value == "required":
            return cls("required")
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
) -> type[ToolParser] | None:
    """The parser that reads this request's output (None: all of it is content). A forced
    choice also sets the request's grammar; one it cannot honour is refused by name."""
    choice = ToolChoice.of(chat)
    if choice.mode == "none":
        return None
    if parser is None:
        if choice.is_forced:
            raise InvalidArgumentError(
                f"{choice.mode!r} needs the server to run a --tool-call-parser",
                field="tool_choice",
            )
        return None
    if choice.is_forced:
        spec = requested.params.grammar
        if spec is not None:
            other = requested.aliases.get(spec.kind, spec.kind)
            raise InvalidArgumentError(f"cannot be combined with {other}", field="tool_choice")
        assert chat.tools is not None  # ToolChoice.of: no tools is "none"
        requested.params.ebnf = await grammars.ebnf(
            structural_tag(parser, chat.tools, choice, lead)
        )
        requested.aliases["ebnf"] = "tools"
    return parser


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
    return {
        "type": "tag",
        "begin": parser.call_begin(function["name"]),
        "content": {
            "type": "json_schema",
            "json_schema": schema,
            "max_whitespace_cnt": JSON_MAX_WHITESPACE,
        },
        "end": parser.CALL_END,
    }


def _thinking(begin: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": THINK_END}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _ebnf_or_error(structural_tag: str) -> tuple[str, str | None]:
    try:
        return structural_tag_ebnf(structural_tag), None
    except GrammarError as exc:
        return "", str(exc)
