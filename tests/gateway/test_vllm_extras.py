"""vLLM's request extras at the gateway: JSON → proto, the no_stop_trim alias, and the
return_token_ids response shapes (the frontend's side is tested live in
tests/integration/test_vllm_semantics.py)."""

from __future__ import annotations

from typing import Any

import pytest
from tokenline.v1 import openai_pb2

from gateway.convert import chat_request_to_proto, completion_request_to_proto
from gateway.errors import GatewayError
from gateway.extra_fields import check_extra_fields
from gateway.render.openai import chat_chunk, chat_completion_to_dict, completion_to_dict
from gateway.schemas import ChatCompletionBody, CompletionBody

EXTRAS = ("add_special_tokens", "truncate_prompt_tokens", "priority")


def chat_body(**fields: Any) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate(
        {"messages": [{"role": "user", "content": "hi"}]} | fields
    )


def completion_body(**fields: Any) -> CompletionBody:
    return CompletionBody.model_validate({"prompt": "p"} | fields)


def test_the_extras_reach_both_requests_and_unset_stays_unset() -> None:
    fields = {"add_special_tokens": True, "truncate_prompt_tokens": -1, "priority": -3}
    chat = chat_request_to_proto(chat_body(**fields, return_token_ids=True), "r")
    text = completion_request_to_proto(completion_body(**fields, return_token_ids=True), "r")
    for req in (chat, text):
        assert [getattr(req, name) for name in EXTRAS] == [True, -1, -3]
        assert req.return_token_ids
    bare = completion_request_to_proto(completion_body(), "r")
    assert not any(bare.HasField(name) for name in EXTRAS) and not bare.return_token_ids


def test_the_extras_are_declared_fields_not_refused_extras() -> None:
    check_extra_fields(
        chat_body(
            add_special_tokens=False,
            truncate_prompt_tokens=5,
            priority=1,
            return_token_ids=True,
            include_stop_str_in_output=True,
        )
    )


def test_a_priority_outside_int32_is_a_400_naming_it() -> None:
    with pytest.raises(GatewayError) as err:
        chat_request_to_proto(chat_body(priority=2**40), "r")
    assert err.value.status == 400 and err.value.param == "priority"


@pytest.mark.parametrize(
    ("fields", "no_stop_trim"),
    [
        ({"include_stop_str_in_output": True}, True),
        ({"include_stop_str_in_output": False}, False),
        ({"no_stop_trim": True}, True),
        ({"include_stop_str_in_output": True, "no_stop_trim": True}, True),
    ],
)
def test_include_stop_str_in_output_is_no_stop_trim(
    fields: dict[str, bool], no_stop_trim: bool
) -> None:
    for req in (
        chat_request_to_proto(chat_body(**fields), "r"),
        completion_request_to_proto(completion_body(**fields), "r"),
    ):
        assert req.sampling.HasField("no_stop_trim")
        assert req.sampling.no_stop_trim is no_stop_trim


def test_contradicting_names_of_the_one_flag_are_refused() -> None:
    body = chat_body(include_stop_str_in_output=True, no_stop_trim=False)
    with pytest.raises(GatewayError) as err:
        chat_request_to_proto(body, "r")
    assert err.value.status == 400 and err.value.param == "include_stop_str_in_output"


def test_token_ids_render_where_vllm_puts_them_and_only_when_filled() -> None:
    chat = openai_pb2.ChatCompletion(id="c", model="m", prompt_token_ids=[5, 6])
    chat.choices.add(index=0, finish_reason="stop", token_ids=[7, 1])
    whole = chat_completion_to_dict(chat, logprobs=False)
    assert whole["prompt_token_ids"] == [5, 6] and whole["choices"][0]["token_ids"] == [7, 1]
    assert whole["choices"][0]["stop_reason"] is None  # no matched stop set: EOS or none
    chunk = openai_pb2.ChatCompletionChunk(id="c", model="m", prompt_token_ids=[5])
    chunk.choices.add(index=0).token_ids.extend([9])
    frame = chat_chunk(chunk, include_usage=False, logprobs=False).dump()
    assert frame["prompt_token_ids"] == [5] and frame["choices"][0]["token_ids"] == [9]
    text = openai_pb2.Completion(id="t", model="m")
    text.choices.add(index=0, text="x", token_ids=[3], prompt_token_ids=[2])
    plain = openai_pb2.Completion(id="t", model="m")
    plain.choices.add(index=0, text="x")
    rendered = completion_to_dict(text, include_usage=False, logprobs=False)["choices"][0]
    assert (rendered["token_ids"], rendered["prompt_token_ids"]) == ([3], [2])
    bare = completion_to_dict(plain, include_usage=False, logprobs=False)["choices"][0]
    assert "token_ids" not in bare and "prompt_token_ids" not in bare
