"""Structured-output cases shared by the scheduler, frontend and live tests: each grammar
and the check its output must pass."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

# Nested objects, an enum, bounded strings and arrays, numbers with bounds, a pattern.
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
PRICE_REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{2})?"
COLORS = ["red", "green", "blue", 'say "hi"']


@dataclass(frozen=True)
class Case:
    """One grammar, as the native fields give it, and how to check its output."""

    name: str
    kind: str  # json_schema | regex | ebnf
    text: str
    schema: dict[str, Any] | None = None
    pattern: str | None = None
    choices: tuple[str, ...] = ()

    def check(self, output: str) -> None:
        """Raise unless ``output`` matches the grammar."""
        if self.schema is not None:
            jsonschema.validate(json.loads(output), self.schema)
        elif self.pattern is not None:
            assert re.fullmatch(self.pattern, output), output
        else:
            assert output in self.choices, output


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


PERSON = Case("json_schema", "json_schema", json.dumps(PERSON_SCHEMA), schema=PERSON_SCHEMA)
PRICE = Case("regex", "regex", PRICE_REGEX, pattern=PRICE_REGEX)
COLOR = Case("choice", "ebnf", choice_ebnf(COLORS), choices=tuple(COLORS))
JSON_OBJECT = Case("json_object", "json_schema", json.dumps(OBJECT_SCHEMA), schema=OBJECT_SCHEMA)

EXPRESSION_EBNF = """root ::= "(" num " " op " " num ")"
num ::= [1-9] [0-9]?
op ::= "+" | "-" | "*"
"""
EXPRESSION = Case("grammar", "ebnf", EXPRESSION_EBNF, pattern=r"\([1-9][0-9]? [+\-*] [1-9][0-9]?\)")
