"""A request's ``GrammarSpec`` as an xgrammar ``Grammar``: the one translation both sides use.

The frontend builds the grammar to refuse an invalid schema, regex or EBNF before
anything is dispatched; the scheduler builds the same grammar and compiles it against
the model's vocabulary. Sharing this function means the two can never disagree about
what a spec means (JSON whitespace, strictness).

xgrammar is imported on first use: it pulls in torch, which the frontend does not
otherwise load at start.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from services.common.sampling_params import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

# JSON output: any whitespace between tokens (what a model trained on pretty-printed JSON
# writes), but at most this many characters in a row, so a model cannot spend its whole
# budget on newlines (a known failure of unbounded whitespace under a grammar).
JSON_MAX_WHITESPACE = 16

# xgrammar (0.2.9) lowers a JSON-schema string with minLength/maxLength to a repetition of
# the first class below, which admits raw control characters (a tab) that JSON forbids
# inside strings (xgrammar issue #800; its own unbounded strings exclude them). Such a
# grammar is printed, given the second class, and parsed back. A version that fixes it
# upstream prints no such class, and the rewrite does nothing.
_BOUNDED_STRING_CLASS = r"[^\"\\\r\n]"
_JSON_STRING_CLASS = r"[^\0-\x1f\"\\\r\n]"

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the client gets the rest.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """The spec does not describe a grammar; the message says why, for the client."""


def build_grammar(spec: GrammarSpec) -> xgrammar.Grammar:
    """The spec as a grammar, or GrammarError. Pure CPU work (ms for a typical schema):
    callers run it off their event loop."""
    import xgrammar

    try:
        if spec.kind == "json_schema":
            _check_json(spec.text)
            grammar = xgrammar.Grammar.from_json_schema(
                spec.text, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
            )
            return _without_raw_control_characters(grammar)
        if spec.kind == "regex":
            return xgrammar.Grammar.from_regex(spec.text)
        return xgrammar.Grammar.from_ebnf(spec.text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(_clean(str(exc))) from None


def _without_raw_control_characters(grammar: xgrammar.Grammar) -> xgrammar.Grammar:
    """``grammar`` with its length-bounded JSON strings closed to U+0000-U+001F."""
    import xgrammar

    text = str(grammar)
    if _BOUNDED_STRING_CLASS not in text:
        return grammar
    return xgrammar.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS))


def structural_tag_ebnf(structural_tag: str) -> str:
    """An xgrammar structural tag (its JSON text) as EBNF text, which ``build_grammar``
    reads back: how a grammar made of tags and JSON schemas (forced tool calls) travels
    as an ordinary ``ebnf`` spec. GrammarError when xgrammar refuses it."""
    import xgrammar

    try:
        return str(xgrammar.Grammar.from_structural_tag(structural_tag))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(_clean(str(exc))) from None


def choice_ebnf(choices: list[str]) -> str:
    """A grammar that matches exactly one of ``choices``. JSON string escapes are the
    EBNF literal's escapes, so any text (quotes, backslashes, newlines) survives."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _check_json(text: str) -> None:
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"not valid JSON: {exc}") from None


def _clean(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    return _CPP_PREFIX.sub("", first)
