"""In-process checks of the pure pieces: JSON → proto, proto → JSON, errors, config."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from tokenline.v1 import common_pb2, openai_pb2

from gateway.config import GatewayConfig, config_from_args
from gateway.convert import (
    chat_request_to_proto,
    completion_request_to_proto,
    generate_request_to_proto,
)
from gateway.errors import GatewayError, error_body, param_from_loc
from gateway.render.openai import (
    chat_chunk,
    chat_completion_to_dict,
    completion_to_dict,
    text_completion,
    usage_to_dict,
)
from gateway.schemas import ChatCompletionBody, CompletionBody, GenerateBody
from gateway.sse import sse_frame


def _chat(**fields: object) -> openai_pb2.ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}]} | fields
    return chat_request_to_proto(ChatCompletionBody.model_validate(body), "rid-1")


def test_chat_tools_tool_choice_and_history() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    req = _chat(
        messages=history,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "f"}},
        parallel_tool_calls=False,
        stream_options={"include_usage": True},
    )
    assert req.request_id == "rid-1"
    assert req.HasField("parallel_tool_calls") and not req.parallel_tool_calls
    assert not _chat().HasField("parallel_tool_calls")  # unset: OpenAI's default, true
    assert json.loads(req.tools[0].function.parameters_json) == {"type": "object"}
    assert json_format.MessageToDict(req.tool_choice)["function"] == {"name": "f"}
    assert req.messages[1].WhichOneof("content_kind") is None
    assert req.messages[1].tool_calls[0].function.arguments == "{}"
    assert req.messages[2].tool_call_id == "c1" and req.messages[2].content == "42"
    assert req.stream_options.include_usage


def test_unset_sampling_fields_stay_unset() -> None:
    req = _chat()
    for name in ("temperature", "top_p", "max_tokens", "seed", "n"):
        assert not req.sampling.HasField(name), name
    assert not req.HasField("max_completion_tokens") and not req.HasField("stream_options")
    assert _chat(temperature=0).sampling.HasField("temperature")  # an explicit 0 is kept


def test_empty_content_parts_still_mean_parts() -> None:
    req = _chat(messages=[{"role": "user", "content": []}])
    assert req.messages[0].WhichOneof("content_kind") == "parts"


def test_logit_bias_keys_become_ints() -> None:
    assert dict(_chat(logit_bias={"50256": -100}).sampling.logit_bias) == {50256: -100.0}
    with pytest.raises(GatewayError) as info:
        _chat(logit_bias={"x": 1})
    assert info.value.status == 400 and info.value.param == "logit_bias"


def test_completion_prompt_forms() -> None:
    def convert(prompt: object) -> openai_pb2.CompletionRequest:
        return completion_request_to_proto(CompletionBody.model_validate({"prompt": prompt}), "r")

    assert list(convert("a").prompts) == ["a"]
    assert list(convert(["a", "b"]).prompts) == ["a", "b"]
    assert [list(t.ids) for t in convert([5, 6]).prompt_token_ids] == [[5, 6]]
    assert [list(t.ids) for t in convert([[5], [6]]).prompt_token_ids] == [[5], [6]]
    assert not convert(["a"]).HasField("logprobs")


def test_chunk_nulls_follow_openai() -> None:
    chunk = openai_pb2.ChatCompletionChunk(
        id="c", choices=[openai_pb2.ChatChunkChoice(delta=openai_pb2.ChatDelta(content="x"))]
    )
    plain = chat_chunk(chunk, include_usage=False, logprobs=False).dump()
    assert "usage" not in plain
    choice = plain["choices"][0]
    assert choice["delta"] == {"content": "x"}
    assert choice["finish_reason"] is None and choice["logprobs"] is None
    assert chat_chunk(chunk, include_usage=True, logprobs=False).dump()["usage"] is None
    assert plain["object"] == "chat.completion.chunk" and plain["created"] > 0


def test_tool_call_delta_and_message_shapes() -> None:
    call = openai_pb2.ToolCall(index=1, function=openai_pb2.ToolCallFunction(arguments='{"a"'))
    chunk = openai_pb2.ChatCompletionChunk(
        choices=[openai_pb2.ChatChunkChoice(delta=openai_pb2.ChatDelta(tool_calls=[call]))]
    )
    delta = chat_chunk(chunk, include_usage=False, logprobs=False).dump()["choices"][0]["delta"]
    assert delta == {"tool_calls": [{"index": 1, "function": {"arguments": '{"a"'}}]}
    full = openai_pb2.ToolCall(
        id="c1", function=openai_pb2.ToolCallFunction(name="f", arguments="{}")
    )
    message = openai_pb2.ChatResponseMessage(role="assistant", tool_calls=[full])
    completion = openai_pb2.ChatCompletion(
        choices=[openai_pb2.ChatChoice(message=message, finish_reason="tool_calls")]
    )
    rendered = chat_completion_to_dict(completion, logprobs=False)["choices"][0]["message"]
    assert rendered["content"] is None
    assert rendered["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"arguments": "{}", "name": "f"}}
    ]


def test_tool_schemas_keep_the_clients_key_order() -> None:
    """A Struct would sort them; the template prints the schema as sent, and forced calls
    generate properties in schema order."""
    schema = {"type": "object", "properties": {"zeta": {}, "alpha": {}}, "required": ["zeta"]}
    req = _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert req.tools[0].function.parameters_json == json.dumps(schema)
    assert not req.tools[0].function.HasField("parameters")


def test_reasoning_effort_and_reasoning_shapes() -> None:
    assert _chat(reasoning_effort="low").reasoning_effort == "low"
    assert not _chat().HasField("reasoning_effort")
    message = openai_pb2.ChatResponseMessage(role="assistant", content="4", reasoning_content="r")
    usage = openai_pb2.CompletionUsage(
        completion_tokens=5,
        completion_tokens_details=openai_pb2.CompletionTokensDetails(reasoning_tokens=3),
    )
    completion = openai_pb2.ChatCompletion(
        choices=[openai_pb2.ChatChoice(message=message, finish_reason="stop")], usage=usage
    )
    rendered = chat_completion_to_dict(completion, logprobs=False)
    assert rendered["choices"][0]["message"]["reasoning_content"] == "r"
    assert rendered["choices"][0]["message"]["reasoning"] == "r"  # vLLM's newer name
    assert rendered["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    plain = chat_completion_to_dict(openai_pb2.ChatCompletion(usage=usage), logprobs=False)
    assert "completion_tokens_details" not in usage_to_dict(openai_pb2.CompletionUsage())
    assert plain["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    chunk = openai_pb2.ChatCompletionChunk(
        choices=[openai_pb2.ChatChunkChoice(delta=openai_pb2.ChatDelta(reasoning_content="think"))]
    )
    delta = chat_chunk(chunk, include_usage=False, logprobs=False).dump()["choices"][0]["delta"]
    assert delta == {"reasoning_content": "think", "reasoning": "think"}


def test_non_finite_logprobs_stay_valid_json() -> None:
    entry = openai_pb2.LogprobEntry(token="a", logprob=float("-inf"))
    choice = openai_pb2.ChatChunkChoice(logprobs=openai_pb2.ChoiceLogprobs(content=[entry]))
    chunk = openai_pb2.ChatCompletionChunk(choices=[choice])
    frame = sse_frame(chat_chunk(chunk, include_usage=False, logprobs=True))
    payload = json.loads(frame.removeprefix(b"data: "))
    assert payload["choices"][0]["logprobs"]["content"][0]["logprob"] == -9999.0


def test_completion_matched_stop_is_stop_reason() -> None:
    choice = openai_pb2.CompletionChoice(text="a", finish_reason="stop", matched_str="\n")
    out = completion_to_dict(
        openai_pb2.Completion(choices=[choice]), include_usage=False, logprobs=False
    )
    assert out["choices"][0]["stop_reason"] == "\n" and out["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("loc", "expected"),
    [
        (("body", "messages", 0, "content", "str"), ("messages[0].content", True)),
        (("body", "messages", 0, "role"), ("messages[0].role", False)),
        (("body", "prompt", "list[int]", 0), ("prompt", True)),
        (("body",), (None, False)),
    ],
)
def test_param_from_loc(loc: tuple[str | int, ...], expected: tuple[str | None, bool]) -> None:
    assert param_from_loc(loc) == expected


def test_error_body_shape() -> None:
    assert error_body(429, "slow down") == {
        "error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": None}
    }
    assert error_body(502, "x")["error"]["type"] == "server_error"


def test_config_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOST", "PORT", "FRONTEND_ADDR", "REQUEST_TIMEOUT", "DRAIN_TIMEOUT", "LOG_LEVEL"):
        monkeypatch.delenv(f"TOKENLINE_{name}", raising=False)
    monkeypatch.setenv("TOKENLINE_MAX_BODY_BYTES", "123")
    monkeypatch.setenv("TOKENLINE_API_KEY", "k")
    config = config_from_args(["--port", "9001", "--request-timeout", "0"])
    assert config == GatewayConfig(
        port=9001, api_key="k", max_body_bytes=123, request_timeout_s=None
    )
    monkeypatch.setenv("TOKENLINE_REQUEST_TIMEOUT", "-1")
    with pytest.raises(SystemExit):
        config_from_args([])


# ---- structured output: each form travels as the client sent it ----------------------


def test_response_format_schema_keeps_its_key_order() -> None:
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    out = _chat(response_format=fmt).sampling.response_format
    assert out.type == "json_schema" and out.json_schema.name == "p"
    assert out.json_schema.strict is True
    assert out.json_schema.schema_json == json.dumps(schema)
    assert list(json.loads(out.json_schema.schema_json)["properties"]) == ["z", "a"]


def test_vllm_structured_outputs_and_guided_fields() -> None:
    so = {"json": {"type": "object"}, "regex": "a+", "choice": ["x", "y"], "grammar": "g"}
    out = _chat(structured_outputs=so | {"json_object": True}).sampling.structured_outputs
    assert (out.json, out.regex, list(out.choice), out.grammar) == (
        '{"type": "object"}',
        "a+",
        ["x", "y"],
        "g",
    )
    assert out.json_object
    sampling = _chat(
        guided_json='{"type": "string"}', guided_regex="b", guided_choice=["c"], guided_grammar="e"
    ).sampling
    assert sampling.guided_json == '{"type": "string"}' and sampling.guided_regex == "b"
    assert list(sampling.guided_choice) == ["c"] and sampling.guided_grammar == "e"
    assert not _chat().sampling.HasField("structured_outputs")


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs.choice"])
def test_an_empty_choice_list_is_refused(field: str) -> None:
    body = (
        {"guided_choice": []}
        if field == "guided_choice"
        else {"structured_outputs": {"choice": []}}
    )
    with pytest.raises(GatewayError) as info:
        _chat(**body)
    assert info.value.param == field


def test_native_json_schema_as_an_object_becomes_text() -> None:
    body = GenerateBody.model_validate(
        {"text": "p", "sampling_params": {"json_schema": {"type": "object"}, "regex": "r"}}
    )
    params = generate_request_to_proto(body, "rid").sampling_params
    assert params.json_schema == '{"type": "object"}' and params.regex == "r"


def test_prompt_logprob_fields_reach_the_protos() -> None:
    assert _chat(prompt_logprobs=3).prompt_logprobs == 3
    body = CompletionBody.model_validate({"prompt": "p", "prompt_logprobs": 0, "echo": True})
    out = completion_request_to_proto(body, "r")
    assert out.HasField("prompt_logprobs") and out.prompt_logprobs == 0 and out.echo
    native = GenerateBody.model_validate(
        {"text": "p", "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 1}
    )
    opts = generate_request_to_proto(native, "rid").logprob
    assert opts.return_logprob and opts.logprob_start_len == 2 and opts.top_logprobs_num == 1
    assert not generate_request_to_proto(GenerateBody(text="p"), "r").logprob.HasField(
        "logprob_start_len"
    )


def test_prompt_logprobs_render_as_vllm_and_echo_starts_with_null() -> None:
    first = common_pb2.TokenLogprob(token_id=0, no_logprob=True)
    top = [common_pb2.TopLogprob(token_id=7, logprob=-0.25, text="b"),
           common_pb2.TopLogprob(token_id=5, logprob=-1.5, text="a")]  # fmt: skip
    second = common_pb2.TokenLogprob(token_id=5, logprob=-1.5, rank=2, text="a", top=top)
    choice = openai_pb2.CompletionChoice(text="ab", prompt_logprobs=[first, second])
    choice.logprobs.tokens.extend(["<s>", "a"])
    choice.logprobs.token_logprobs.extend([0.0, -1.5])
    choice.logprobs.top_logprobs.add()
    choice.logprobs.top_logprobs.add().fields["b"].number_value = -0.25
    choice.logprobs.is_first_null = True
    body = completion_to_dict(
        openai_pb2.Completion(choices=[choice]), include_usage=False, logprobs=True
    )["choices"][0]
    assert body["prompt_logprobs"] == [
        None,
        {
            "5": {"logprob": -1.5, "rank": 2, "decoded_token": "a"},  # its own rank, not 2nd
            "7": {"logprob": -0.25, "rank": 1, "decoded_token": "b"},
        },
    ]
    assert body["logprobs"]["token_logprobs"] == [None, -1.5]
    assert body["logprobs"]["top_logprobs"] == [None, {"b": -0.25}]
    plain = completion_to_dict(
        openai_pb2.Completion(choices=[openai_pb2.CompletionChoice(text="x")]),
        include_usage=False,
        logprobs=False,
    )
    assert "prompt_logprobs" not in plain["choices"][0]
    chat = openai_pb2.ChatCompletion(prompt_logprobs=[first, second])
    assert chat_completion_to_dict(chat, logprobs=False)["prompt_logprobs"][0] is None


def test_a_streamed_model_frame_says_what_its_dict_frame_says() -> None:
    """Streams write response models with pydantic-core, the rest goes through json.dumps:
    the same keys and values (nulls kept, unset fields left out), UTF-8 unescaped."""
    entry = openai_pb2.LogprobEntry(token="é", logprob=-1e-05, bytes=b"\xc3\xa9")
    choice = openai_pb2.ChatChunkChoice(
        index=0, logprobs=openai_pb2.ChoiceLogprobs(content=[entry])
    )
    choice.delta.content = "héllo ✓"
    chunk = openai_pb2.ChatCompletionChunk(id="c1", model="m", created=7, choices=[choice])
    model = chat_chunk(chunk, include_usage=True, logprobs=True)
    completion = openai_pb2.CompletionChunk(id="c2", model="m", created=7)
    completion.choices.add(index=1, text="日本", finish_reason="stop", matched_token_id=2)
    text = text_completion(completion, include_usage=False, logprobs=False)
    for rendered in (model, text):
        frame = sse_frame(rendered)
        assert frame.startswith(b"data: {") and frame.endswith(b"}\n\n")
        assert json.loads(frame[6:]) == json.loads(sse_frame(rendered.dump())[6:])
    assert "héllo ✓".encode() in sse_frame(model) and b"\\u" not in sse_frame(model)
    assert json.loads(sse_frame(model)[6:])["usage"] is None
    assert json.loads(sse_frame(text)[6:])["choices"][0]["stop_reason"] == 2
