"""OpenAI / native JSON bodies → request protos.

The JSON quirks end here: `stop` as string or list, `content` as string or parts,
`prompt` as text(s) or token id list(s), logit_bias keys as strings. Precedence
rules (max_completion_tokens over max_tokens) and value ranges stay with the
frontend, so the gateway forwards what the client said and nothing more.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from google.protobuf import json_format, struct_pb2
from google.protobuf.message import Message
from tokenline.v1 import embeddings_pb2, frontend_pb2, generate_pb2, openai_pb2

from gateway.errors import GatewayError
from gateway.schemas import (
    ChatCompletionBody,
    ChatMessageBody,
    CompletionBody,
    DetokenizeBody,
    EmbeddingsBody,
    GenerateBody,
    SharedRequestBody,
    TokenizeBody,
    ToolBody,
    ToolCallBody,
)

# Scalar fields copied verbatim from the body into OpenAISampling when present.
_SAMPLING_SCALARS = (
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "max_tokens", "min_tokens", "ignore_eos", "seed", "n",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
)  # fmt: skip


@contextmanager
def _field(param: str) -> Iterator[None]:
    """Turn protobuf's range/type errors into a 400 that names the field."""
    try:
        yield
    except (ValueError, TypeError, OverflowError, json_format.ParseError) as exc:
        raise GatewayError(400, f"{param}: {exc}", param=param, code="invalid_value") from None


def _set_present(message: Message, source: Any, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(source, name)
        if value is not None:
            with _field(name):
                setattr(message, name, value)


def normalize_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _struct(value: dict[str, Any], param: str) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    with _field(param):
        out.update(value)
    return out


def _sampling(body: SharedRequestBody) -> openai_pb2.OpenAISampling:
    out = openai_pb2.OpenAISampling(stop=normalize_stop(body.stop))
    _set_present(out, body, _SAMPLING_SCALARS)
    _include_stop_str_into(out, body)
    with _field("stop_token_ids"):
        out.stop_token_ids.extend(body.stop_token_ids or ())
    with _field("logit_bias"):
        for token_id, bias in (body.logit_bias or {}).items():
            out.logit_bias[int(token_id)] = bias
    _structured_output_into(out, body)
    return out


def _include_stop_str_into(out: openai_pb2.OpenAISampling, body: SharedRequestBody) -> None:
    """vLLM's include_stop_str_in_output is SGLang's no_stop_trim: one flag, two names."""
    given = body.include_stop_str_in_output
    if given is None:
        return
    if body.no_stop_trim is not None and body.no_stop_trim != given:
        param = "include_stop_str_in_output"
        why = "contradicts no_stop_trim, the same flag under SGLang's name"
        raise GatewayError(400, f"{param}: {why}", param=param, code="invalid_value")
    out.no_stop_trim = given


def _vllm_extras_into(
    out: openai_pb2.ChatCompletionRequest | openai_pb2.CompletionRequest,
    body: ChatCompletionBody | CompletionBody,
) -> None:
    """vLLM's prompt and output extras; their ranges are the frontend's to check."""
    _set_present(out, body, ("add_special_tokens", "truncate_prompt_tokens", "priority"))
    out.return_token_ids = bool(body.return_token_ids)


def schema_text(schema: str | dict[str, Any]) -> str:
    """A schema as JSON text; an object keeps its key order (properties are generated
    in schema order)."""
    return schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)


def _choices(choices: list[str], param: str) -> list[str]:
    if not choices:
        raise GatewayError(400, f"{param}: must not be empty", param=param, code="invalid_value")
    return choices


def _structured_output_into(out: openai_pb2.OpenAISampling, body: SharedRequestBody) -> None:
    """Each form as the client sent it; the frontend picks (and checks) the grammar."""
    fmt = body.response_format
    if fmt is not None:
        out.response_format.type = fmt.type
        if fmt.json_schema is not None:
            spec = out.response_format.json_schema
            spec.name = fmt.json_schema.name
            spec.description = fmt.json_schema.description or ""
            if fmt.json_schema.schema_ is not None:
                spec.schema_json = schema_text(fmt.json_schema.schema_)
            if fmt.json_schema.strict is not None:
                spec.strict = fmt.json_schema.strict
    so = body.structured_outputs
    if so is not None:
        target = out.structured_outputs
        target.SetInParent()
        if so.json_ is not None:
            target.json = schema_text(so.json_)
        _set_present(target, so, ("regex", "grammar", "json_object"))
        if so.choice is not None:
            target.choice.extend(_choices(so.choice, "structured_outputs.choice"))
    if body.guided_json is not None:
        out.guided_json = schema_text(body.guided_json)
    _set_present(out, body, ("guided_regex", "guided_grammar"))
    if body.guided_choice is not None:
        out.guided_choice.extend(_choices(body.guided_choice, "guided_choice"))


def _stream_options(body: SharedRequestBody) -> openai_pb2.StreamOptions | None:
    opts = body.stream_options
    if opts is None:
        return None
    return openai_pb2.StreamOptions(
        include_usage=opts.include_usage, continuous_usage_stats=opts.continuous_usage_stats
    )


def _tool_call(call: ToolCallBody, index: int) -> openai_pb2.ToolCall:
    fn = openai_pb2.ToolCallFunction(name=call.function.name, arguments=call.function.arguments)
    position = index if call.index is None else call.index
    return openai_pb2.ToolCall(id=call.id, type=call.type, function=fn, index=position)


def _message(msg: ChatMessageBody) -> openai_pb2.ChatMessage:
    out = openai_pb2.ChatMessage(
        role=msg.role,
        name=msg.name or "",
        tool_call_id=msg.tool_call_id or "",
        reasoning_content=msg.reasoning_content or "",
        tool_calls=[_tool_call(c, i) for i, c in enumerate(msg.tool_calls or ())],
    )
    content_into(out, msg.content)
    return out


def content_into(out: Any, content: str | list[Any] | None) -> None:
    """``content`` as a string or as text parts (each with ``type`` and ``text``) into a
    proto with the ``content`` / ``parts`` oneof (a chat message, a Responses input item)."""
    if isinstance(content, str):
        out.content = content
    elif content is not None:
        out.parts.SetInParent()  # an empty list is still "parts", not "no content"
        out.parts.parts.extend(
            openai_pb2.ContentPart(type=p.type, text=p.text or "") for p in content
        )


def _tool(tool: ToolBody, index: int) -> openai_pb2.Tool:
    fn = tool.function
    out = openai_pb2.Tool(type=tool.type)
    out.function.name = fn.name
    out.function.description = fn.description or ""
    if fn.parameters is not None:
        # As JSON text: a Struct would sort the keys, and the template prints the schema
        # (and forced calls generate properties) in the client's order.
        with _field(f"tools[{index}].function.parameters"):
            out.function.parameters_json = json.dumps(fn.parameters, ensure_ascii=False)
    return out


def chat_request_to_proto(
    body: ChatCompletionBody, request_id: str
) -> openai_pb2.ChatCompletionRequest:
    """Build the frontend's ChatCompletionRequest; `request_id` becomes the rid prefix."""
    out = openai_pb2.ChatCompletionRequest(
        model=body.model,
        messages=[_message(m) for m in body.messages],
        sampling=_sampling(body),
        stream=body.stream,
        stream_options=_stream_options(body),
        logprobs=body.logprobs,
        tools=[_tool(t, i) for i, t in enumerate(body.tools or ())],
        continue_final_message=body.continue_final_message,
        user=body.user or "",
        request_id=request_id,
    )
    _set_present(
        out,
        body,
        (
            "max_completion_tokens", "top_logprobs", "add_generation_prompt", "reasoning_effort",
            "prompt_logprobs", "parallel_tool_calls",
        ),
    )  # fmt: skip
    _vllm_extras_into(out, body)
    if body.tool_choice is not None:
        with _field("tool_choice"):
            json_format.ParseDict(body.tool_choice, out.tool_choice)
    if body.chat_template_kwargs is not None:
        out.chat_template_kwargs.CopyFrom(
            _struct(body.chat_template_kwargs, "chat_template_kwargs")
        )
    return out


def _prompt_into(
    out: openai_pb2.CompletionRequest, prompt: str | list[str] | list[int] | list[list[int]]
) -> None:
    if isinstance(prompt, str):
        out.prompts.append(prompt)
        return
    if not prompt:
        raise GatewayError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
    with _field("prompt"):
        if isinstance(prompt[0], str):
            out.prompts.extend(prompt)
        elif isinstance(prompt[0], int):
            out.prompt_token_ids.add(ids=prompt)
        else:
            for ids in prompt:
                out.prompt_token_ids.add(ids=ids)


def completion_request_to_proto(
    body: CompletionBody, request_id: str
) -> openai_pb2.CompletionRequest:
    """Build the frontend's CompletionRequest (one `prompts`/`prompt_token_ids` entry each)."""
    out = openai_pb2.CompletionRequest(
        model=body.model,
        sampling=_sampling(body),
        stream=body.stream,
        stream_options=_stream_options(body),
        echo=body.echo,
        suffix=body.suffix or "",
        user=body.user or "",
        request_id=request_id,
    )
    _prompt_into(out, body.prompt)
    _vllm_extras_into(out, body)
    _set_present(out, body, ("logprobs", "prompt_logprobs"))
    return out


# SGLang's flat logprob fields, which proto JSON nests under `logprob`.
_LOGPROB_SHORTHANDS = ("return_logprob", "top_logprobs_num", "logprob_start_len")


def _generate_json(body: GenerateBody, request_id: str) -> dict[str, Any]:
    """Rewrite SGLang's shorthands into proto JSON for GenerateReqInput."""
    data = body.model_dump(exclude_none=True, exclude=set(_LOGPROB_SHORTHANDS))
    data["rid"] = body.rid or request_id
    if isinstance(body.text, str):
        data["text"] = [body.text]
    ids = body.input_ids
    if ids and isinstance(ids[0], int):
        data["input_ids"] = [{"ids": ids}]
    elif ids and isinstance(ids[0], list):
        data["input_ids"] = [{"ids": row} for row in ids]
    sampling = data.get("sampling_params", {})
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    if "json_schema" in sampling:
        sampling["json_schema"] = schema_text(sampling["json_schema"])
    logprob = data.setdefault("logprob", {})
    for name in _LOGPROB_SHORTHANDS:
        value = getattr(body, name)
        if value is not None:
            logprob[name] = value
    return data


def generate_request_to_proto(body: GenerateBody, request_id: str) -> generate_pb2.GenerateReqInput:
    """Native request: proto JSON (either field-name style) with SGLang's shorthands."""
    data = _generate_json(body, request_id)
    try:
        return json_format.ParseDict(
            data, generate_pb2.GenerateReqInput(), ignore_unknown_fields=True
        )
    except json_format.ParseError as exc:
        raise GatewayError(400, str(exc), code="invalid_value") from None


# The fields of a tokenize body that a chat request reads when it templates `messages`.
_TOKENIZE_CHAT_FIELDS = frozenset(
    {"model", "messages", "tools", "add_generation_prompt", "continue_final_message"}
    | {"chat_template_kwargs"}
)


def tokenize_request_to_proto(body: TokenizeBody, request_id: str) -> frontend_pb2.TokenizeRequest:
    """`prompt` as text, or `messages` as the chat request the frontend templates."""
    if (body.prompt is None) == (body.messages is None):
        raise GatewayError(
            400, "prompt: give either prompt or messages", param="prompt", code="invalid_value"
        )
    out = frontend_pb2.TokenizeRequest(
        model=body.model, prompt=body.prompt or "", return_token_strs=body.return_token_strs
    )
    is_chat = body.messages is not None
    add_special = body.add_special_tokens
    out.add_special_tokens = not is_chat if add_special is None else add_special
    if is_chat:
        fields = body.model_dump(exclude_none=True, include=set(_TOKENIZE_CHAT_FIELDS))
        chat = ChatCompletionBody.model_validate(fields)
        out.chat.CopyFrom(chat_request_to_proto(chat, request_id))
    return out


def detokenize_request_to_proto(body: DetokenizeBody) -> frontend_pb2.DetokenizeRequest:
    out = frontend_pb2.DetokenizeRequest(model=body.model)
    with _field("tokens"):
        out.tokens.extend(body.tokens)
    return out


def embeddings_request_to_proto(
    body: EmbeddingsBody, request_id: str
) -> embeddings_pb2.EmbeddingRequest:
    """Build the frontend's EmbeddingRequest; `input`'s JSON shape picks its oneof."""
    out = embeddings_pb2.EmbeddingRequest(
        model=body.model,
        encoding_format=body.encoding_format or "",
        user=body.user or "",
        request_id=request_id,
    )
    _set_present(out, body, ("dimensions", "normalize"))
    value = body.input
    if isinstance(value, str):
        out.text = value
    elif value and all(isinstance(v, int) for v in value):
        out.token_ids.ids.extend(value)  # type: ignore[arg-type]
    elif value and all(isinstance(v, list) for v in value):
        out.token_id_lists.lists.extend(openai_pb2.TokenIds(ids=v) for v in value)  # type: ignore[misc]
    else:
        out.texts.texts.extend(value)  # type: ignore[arg-type]
    return out
