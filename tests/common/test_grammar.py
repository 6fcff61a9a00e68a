"""``build_grammar``'s JSON schemas: a length-bounded string admits no raw control
character, as JSON requires (xgrammar 0.2.9 lowered it to a class that let a tab through,
and a structured-output test saw one in a ``json.loads``-rejected answer)."""

from __future__ import annotations

import json

import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from services.common.grammar import build_grammar
from services.common.sampling_params import GrammarSpec
from tests.structured_cases import PERSON_SCHEMA


def schema_grammar(schema: dict) -> object:
    return build_grammar(GrammarSpec("json_schema", json.dumps(schema)))


@pytest.mark.parametrize("bounds", [{"maxLength": 8}, {"minLength": 1, "maxLength": 8}, {}])
def test_a_string_takes_text_but_no_raw_control_character(bounds: dict) -> None:
    grammar = schema_grammar({"type": "string", **bounds})
    assert accepts(grammar, '"ab é東"')
    for raw in ("\t", "\x01", "\x1f", "\n"):
        assert not accepts(grammar, f'"a{raw}b"'), repr(raw)


def test_a_nested_schema_accepts_valid_json_and_refuses_a_tab_in_a_bounded_field() -> None:
    grammar = schema_grammar(PERSON_SCHEMA)
    person = {
        "name": "Ann",
        "age": 30,
        "role": "user",
        "tags": ["a"],
        "address": {"city": "Oslo", "zip": "01234"},
    }
    assert accepts(grammar, json.dumps(person))
    assert not accepts(grammar, json.dumps(person).replace("Ann", "A\tn"))
