"""Structured output through the real stack and the random default model.

20 seeds x 5 forms (OpenAI response_format json_object and json_schema, vLLM regex,
guided_choice and an EBNF grammar) through the openai SDK: every output that finishes
with ``stop`` must match its grammar, and the bounded forms must finish with ``stop``
within the budget. ``json_object`` is checked for validity only: the random model writes
strings that almost never close (about 330 of 129,280 tokens contain a quote, and its
distribution is peaked elsewhere), so the only objects it finishes are short ones such
as ``{}``. Its budget is short for that reason: an object still open after 48 tokens
seldom closes. The same grammars also go through gRPC as proto JSON, the way a non-Python
client sends them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import openai
import pydantic
import pytest
from google.protobuf import json_format
from tokenline.v1 import frontend_pb2_grpc, generate_pb2, openai_pb2

from services.launch import LocalStack
from tests.structured_cases import (
    COLOR,
    COLORS,
    EXPRESSION,
    JSON_OBJECT,
    PERSON,
    PERSON_SCHEMA,
    PRICE,
    Case,
)

SEEDS = range(20)
BUDGET = 256  # max_tokens: the person schema takes 100-160 tokens with this model
SHORT_BUDGET = 48  # json_object's: the objects this model closes are a few tokens long
MIN_STOP_RATE = 0.9

# (case, what the request adds to create(): the client's own form of the grammar)
FORMS: list[tuple[Case, dict[str, Any]]] = [
    (JSON_OBJECT, {"response_format": {"type": "json_object"}, "max_tokens": SHORT_BUDGET}),
    (
        PERSON,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
            }
        },
    ),
    (PRICE, {"extra_body": {"structured_outputs": {"regex": PRICE.text}}}),
    (COLOR, {"extra_body": {"guided_choice": COLORS}}),
    (EXPRESSION, {"extra_body": {"structured_outputs": {"grammar": EXPRESSION.text}}}),
]


def ask(client: openai.OpenAI, model_id: str, seed: int, form: dict[str, Any]) -> Any:
    return client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": f"Request {seed}: answer in the asked format."}],
        seed=seed,
        **{"max_tokens": BUDGET, **form},
    )


@pytest.fixture(scope="module")
def results(client: openai.OpenAI, model_id: str) -> dict[str, list[tuple[str, str]]]:
    """(finish_reason, content) per form, all 100 requests in flight together."""
    jobs: list[tuple[str, Callable[[], Any]]] = [
        (case.name, lambda seed=seed, form=form: ask(client, model_id, seed, form))
        for case, form in FORMS
        for seed in SEEDS
    ]
    with ThreadPoolExecutor(32) as pool:
        futures = [(name, pool.submit(job)) for name, job in jobs]
        done = [(name, f.result()) for name, f in futures]
    out: dict[str, list[tuple[str, str]]] = {}
    for name, response in done:
        choice = response.choices[0]
        out.setdefault(name, []).append((choice.finish_reason, choice.message.content))
    return out


@pytest.mark.parametrize("case", [form[0] for form in FORMS], ids=lambda c: c.name)
def test_every_output_that_stops_matches_its_grammar(
    results: dict[str, list[tuple[str, str]]], case: Case
) -> None:
    outputs = results[case.name]
    assert len(outputs) == len(SEEDS)
    stopped = [text for finish, text in outputs if finish == "stop"]
    for text in stopped:
        case.check(text)
    assert {finish for finish, _ in outputs} <= {"stop", "length"}
    rate = len(stopped) / len(outputs)
    print(f"{case.name}: {len(stopped)}/{len(outputs)} finished with stop")
    if case is JSON_OBJECT:
        assert stopped, "not one json_object output finished"
    else:
        assert rate >= MIN_STOP_RATE, f"{case.name}: only {rate:.0%} finished with stop"


def test_the_sdk_parses_into_a_pydantic_model(client: openai.OpenAI, model_id: str) -> None:
    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        kind: str = pydantic.Field(pattern="^(cat|dog)$")
        age: int

    completion = client.chat.completions.parse(
        model=model_id,
        messages=[{"role": "user", "content": "A pet, please."}],
        response_format=Pet,
        max_tokens=BUDGET,
        seed=3,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)


def test_streamed_deltas_equal_the_whole_output(client: openai.OpenAI, model_id: str) -> None:
    form = FORMS[1][1]
    whole = ask(client, model_id, 7, form).choices[0]
    chunks = list(ask(client, model_id, 7, form | {"stream": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"
    PERSON.check(text)


@pytest.mark.parametrize(
    ("form", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
        ({"extra_body": {"structural_tag": "x"}}, "structural_tag"),
        ({"extra_body": {"surprise": True}}, "surprise"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    client: openai.OpenAI, model_id: str, form: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, model_id, 1, form)
    assert info.value.body["param"] == param  # type: ignore[index]


# ---- gRPC: proto JSON as any language writes it (camelCase, schema as an object) ------

CHAT_JSON = {
    "messages": [{"role": "user", "content": "A person, please."}],
    "sampling": {
        "maxTokens": BUDGET,
        "seed": "11",
        "responseFormat": {
            "type": "json_schema",
            "jsonSchema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    },
}
GENERATE_JSON = {
    "text": ["Colour:", "Price:", "Sum:"],
    "samplingParams": {"maxNewTokens": 64, "seed": "5"},
}


@pytest.fixture(scope="module")
def frontend(stack: LocalStack) -> Any:
    with grpc.insecure_channel(stack.addr("frontend")) as channel:
        yield frontend_pb2_grpc.FrontendServiceStub(channel)


def test_grpc_chat_with_a_proto_json_response_format(frontend: Any) -> None:
    request = json_format.Parse(json.dumps(CHAT_JSON), openai_pb2.ChatCompletionRequest())
    choice = frontend.ChatCompletion(request, timeout=120).choices[0]
    assert choice.finish_reason == "stop"
    PERSON.check(choice.message.content)


@pytest.mark.parametrize("case", [COLOR, PRICE, EXPRESSION], ids=lambda c: c.name)
def test_grpc_generate_with_sglangs_fields(frontend: Any, case: Case) -> None:
    body = json.loads(json.dumps(GENERATE_JSON))
    body["samplingParams"][case.kind] = case.text
    request = json_format.Parse(json.dumps(body), generate_pb2.GenerateReqInput())
    outputs = frontend.Generate(request, timeout=120).outputs
    assert len(outputs) == 3
    for output in outputs:
        assert output.finish_reason.kind == output.finish_reason.KIND_STOP
        case.check(output.text)


def test_grpc_refuses_an_invalid_grammar_by_name(frontend: Any) -> None:
    body = {"text": ["x"], "samplingParams": {"regex": "(unclosed"}}
    request = json_format.Parse(json.dumps(body), generate_pb2.GenerateReqInput())
    with pytest.raises(grpc.RpcError) as info:
        frontend.Generate(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "regex" in info.value.details()
