"""Structured output in the frontend: every API form becomes one grammar, two forms are
refused by name, and an invalid grammar is INVALID_ARGUMENT naming the client's field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from google.protobuf import json_format
from tokenline.v1 import common_pb2, openai_pb2

from services.common.errors import InvalidArgumentError
from services.common.grammar import choice_ebnf
from services.frontend.validation.limits import ModelLimits
from services.frontend.validation.params import (
    check_sampling,
    params_from_native,
    params_from_openai,
)
from services.frontend.validation.structured_output import JSON_OBJECT_SCHEMA, GrammarChecker
from tests.structured_cases import PERSON_SCHEMA

LIMITS = ModelLimits(vocab_size=1000, context_length=100, default_max_tokens=30)
SCHEMA_TEXT = json.dumps(PERSON_SCHEMA)


def sampling(**fields: Any) -> openai_pb2.OpenAISampling:
    """OpenAISampling from proto JSON, the way a non-Python gRPC client writes it."""
    return json_format.ParseDict(fields, openai_pb2.OpenAISampling())


def grammar_of(**fields: Any) -> tuple[str, str, str] | None:
    """(kind, text, the client field errors name) the request ends up with."""
    requested = params_from_openai(sampling(**fields))
    spec = requested.params.grammar
    return None if spec is None else (spec.kind, spec.text, requested.aliases[spec.kind])


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"responseFormat": {"type": "text"}}, None),
        (
            {"responseFormat": {"type": "json_object"}},
            ("json_schema", JSON_OBJECT_SCHEMA, "response_format"),
        ),
        (
            {"responseFormat": {"type": "json_schema", "jsonSchema": {"schemaJson": SCHEMA_TEXT}}},
            ("json_schema", SCHEMA_TEXT, "response_format.json_schema.schema"),
        ),
        (
            {"structuredOutputs": {"json": SCHEMA_TEXT}},
            ("json_schema", SCHEMA_TEXT, "structured_outputs.json"),
        ),
        ({"structuredOutputs": {"regex": "a+"}}, ("regex", "a+", "structured_outputs.regex")),
        (
            {"structuredOutputs": {"choice": ["a", "b"]}},
            ("ebnf", choice_ebnf(["a", "b"]), "structured_outputs.choice"),
        ),
        (
            {"structuredOutputs": {"grammar": 'root ::= "x"'}},
            ("ebnf", 'root ::= "x"', "structured_outputs.grammar"),
        ),
        (
            {"structuredOutputs": {"jsonObject": True}},
            ("json_schema", JSON_OBJECT_SCHEMA, "structured_outputs.json_object"),
        ),
        ({"guidedJson": SCHEMA_TEXT}, ("json_schema", SCHEMA_TEXT, "guided_json")),
        ({"guidedRegex": "b+"}, ("regex", "b+", "guided_regex")),
        ({"guidedChoice": ["x"]}, ("ebnf", choice_ebnf(["x"]), "guided_choice")),
        ({"guidedGrammar": 'root ::= "y"'}, ("ebnf", 'root ::= "y"', "guided_grammar")),
    ],
)
def test_every_form_becomes_one_grammar(
    fields: dict[str, Any], expected: tuple[str, str, str] | None
) -> None:
    assert grammar_of(**fields) == expected


def test_a_schema_given_as_an_object_keeps_integers_integers() -> None:
    fmt = {"type": "json_schema", "jsonSchema": {"name": "p", "schema": PERSON_SCHEMA}}
    kind, text, _ = grammar_of(responseFormat=fmt)
    assert kind == "json_schema" and json.loads(text) == PERSON_SCHEMA
    assert '"maxLength": 12' in text


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"responseFormat": {"type": "json_object"}, "guidedRegex": "a"}, "guided_regex"),
        ({"structuredOutputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        ({"responseFormat": {"type": "yaml"}}, "response_format.type"),
        ({"responseFormat": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ],
)
def test_conflicting_or_incomplete_forms_are_refused_by_name(
    fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        params_from_openai(sampling(**fields))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"guidedRegex": "   "}, "guided_regex"),
        ({"guidedRegex": "a", "minTokens": 2}, "min_tokens"),
    ],
)
def test_range_checks_name_the_clients_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        check_sampling(params_from_openai(sampling(**fields)), LIMITS)
    assert info.value.field == field


def test_native_fields_are_sglangs_and_two_are_refused() -> None:
    pb = common_pb2.SamplingParams(json_schema=SCHEMA_TEXT)
    assert params_from_native(pb).params.grammar.kind == "json_schema"
    with pytest.raises(InvalidArgumentError) as info:
        check_sampling(params_from_native(common_pb2.SamplingParams(regex="a", ebnf="b")), LIMITS)
    assert info.value.field == "ebnf"


# ---- the grammar check --------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"guidedJson": '{"type": "nope"}'}, "guided_json", "nope"),
        ({"guidedJson": "{not json"}, "guided_json", "not valid JSON"),
        (
            {"responseFormat": {"type": "json_schema", "jsonSchema": {"schemaJson": "[1"}}},
            "response_format.json_schema.schema",
            "not valid JSON",
        ),
        ({"structuredOutputs": {"regex": "[a-"}}, "structured_outputs.regex", "Unclosed"),
        ({"guidedGrammar": "root ::= "}, "guided_grammar", "EBNF"),
    ],
)
async def test_an_invalid_grammar_is_invalid_argument_naming_the_field(
    fields: dict[str, Any], field: str, message: str
) -> None:
    requested = params_from_openai(sampling(**fields))
    with pytest.raises(InvalidArgumentError) as info:
        await GrammarChecker().check(requested.params, requested.aliases)
    assert info.value.field == field and message in info.value.message
    assert not info.value.message.startswith("[")  # xgrammar's C++ location is cut off


async def test_each_grammar_is_built_once_and_valid_ones_pass() -> None:
    checker = GrammarChecker(max_entries=2)
    requested = params_from_openai(sampling(guidedJson=SCHEMA_TEXT))
    await asyncio.gather(*(checker.check(requested.params, requested.aliases) for _ in range(5)))
    assert len(checker._errors) == 1
    for regex in ("a", "b", "c"):
        other = params_from_openai(sampling(guidedRegex=regex))
        await checker.check(other.params, other.aliases)
    assert len(checker._errors) == 2  # least recently used dropped
