"""No silent drops: every undeclared body field is accepted as harmless metadata, accepted at
its no-op default, or refused with a 400 that names it (gateway/extra_fields.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.extra_fields import DEFAULT_ONLY, METADATA, UNSUPPORTED, check_extra_fields
from gateway.schemas import ChatCompletionBody, CompletionBody, GenerateBody, TokenizeBody

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"messages": MESSAGES} | fields)


def body_with(path: str, value: Any) -> ChatCompletionBody:
    """A chat body with ``value`` at a table path (``[]`` meaning the first item)."""
    data: dict[str, Any] = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "structured_outputs": {},
    }
    *parents, leaf = path.replace("[]", ".0").split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[leaf] = value
    return ChatCompletionBody.model_validate(data)


def refused_param(body: Any) -> str | None:
    with pytest.raises(GatewayError) as info:
        check_extra_fields(body)
    assert info.value.status == 400 and info.value.code == "unsupported_field"
    assert info.value.message.startswith(f"{info.value.param}: ")
    return info.value.param


@pytest.mark.parametrize("path", sorted(METADATA))
def test_metadata_is_accepted_and_logged_at_debug(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="gateway.extra_fields"):
        check_extra_fields(body_with(path, {"any": "value"}))
    assert "ignored field" in caplog.text


@pytest.mark.parametrize("path", sorted(DEFAULT_ONLY))
def test_default_only_fields_pass_at_their_default_and_are_refused_otherwise(path: str) -> None:
    check_extra_fields(body_with(path, DEFAULT_ONLY[path]))
    assert refused_param(body_with(path, "something else")) == path.replace("[]", "[0]")


@pytest.mark.parametrize("path", sorted(UNSUPPORTED))
def test_known_unsupported_fields_are_refused_with_the_reason(path: str) -> None:
    with pytest.raises(GatewayError) as info:
        check_extra_fields(body_with(path, "on"))
    assert info.value.param == path.replace("[]", "[0]")
    assert UNSUPPORTED[path] in info.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(surprise=1), "surprise"),
        (chat(messages=[{"role": "user", "content": "hi", "prefix": True}]), "messages[0].prefix"),
        (chat(stream_options={"include_usage": True, "x": 1}), "stream_options.x"),
        (chat(response_format={"type": "json_schema", "json_schema": {"x": 1}}), None),
        (CompletionBody.model_validate({"prompt": "p", "echo_back": 1}), "echo_back"),
        (
            GenerateBody.model_validate({"text": "p", "sampling_params": {"stop_regex": "x"}}),
            "sampling_params.stop_regex",
        ),
        (TokenizeBody.model_validate({"prompt": "p", "mm_processor_kwargs": {}}), None),
    ],
)
def test_unknown_fields_anywhere_are_refused_by_path(body: Any, param: str | None) -> None:
    expected = (
        param
        or {
            ChatCompletionBody: "response_format.json_schema.x",
            TokenizeBody: "mm_processor_kwargs",
        }[type(body)]
    )
    assert refused_param(body) == expected


def test_a_null_field_asks_for_nothing_and_passes() -> None:
    check_extra_fields(chat(functions=None, surprise=None))
    check_extra_fields(chat(messages=[{"role": "assistant", "content": "x", "audio": None}]))


def test_declared_fields_are_not_extras() -> None:
    check_extra_fields(
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {}}},
            structured_outputs={"json": {"type": "object"}},
            guided_choice=["a"],
            user="u",
        )
    )


def test_generate_takes_proto_json_names_and_checks_inside_them() -> None:
    def generate(**fields: Any) -> GenerateBody:
        return GenerateBody.model_validate(fields)

    check_extra_fields(generate(inputIds=[{"ids": [1]}], samplingParams={"maxNewTokens": 4}))
    check_extra_fields(generate(text="p", sampling_params={"maxNewTokens": 4, "logitBias": {}}))
    assert refused_param(generate(samplingParams={"stopRegex": "x"})) == "samplingParams.stopRegex"
    assert refused_param(generate(inputIds=[{"ids": [1], "x": 2}])) == "inputIds[0].x"
    assert refused_param(generate(text="p", returnHiddenStates=True)) == "returnHiddenStates"
