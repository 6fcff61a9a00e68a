"""Response protos → the response models of gateway/responses.py → JSON dicts.

The models are the one definition of each JSON shape (and what /openapi.json shows);
this module only decides what goes in them. Proto3 cannot say "null", so the OpenAI
nulls are decided here: `finish_reason` is null until a choice ends, `logprobs` is null
unless asked for, and with `include_usage` every chunk but the last carries
`"usage": null`. A model field left unset is left out of the JSON.
"""

from __future__ import annotations

import base64
import math
import time
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from tokenline.v1 import common_pb2, embeddings_pb2, openai_pb2

from gateway import responses as out
from services.common.stages import stage_durations_ms

# What vLLM sends for -inf logprobs: JSON has no infinity.
_MIN_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def _optional(message: Message, field: str) -> Any:
    return getattr(message, field) if message.HasField(field) else None


def _matched_stop(choice: Message) -> int | str | None:
    """vLLM's `stop_reason`: the stop string or token id that ended the choice."""
    kind = choice.WhichOneof("matched_stop")
    return getattr(choice, kind) if kind else None


def _token_bytes(token: str, raw: Any) -> list[int]:
    return list(raw) if len(raw) else list(token.encode("utf-8"))


def _created(message: Any) -> int:
    return message.created or int(time.time())


def _usage(usage: openai_pb2.CompletionUsage) -> out.Usage:
    details = None
    if usage.HasField("prompt_tokens_details"):
        details = out.PromptTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens)
    fields: dict[str, Any] = {}
    if usage.HasField("completion_tokens_details"):  # only with a reasoning parser
        reasoning = usage.completion_tokens_details.reasoning_tokens
        fields["completion_tokens_details"] = out.CompletionTokensDetails(
            reasoning_tokens=reasoning
        )
    return out.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=details,
        **fields,
    )


def usage_to_dict(usage: openai_pb2.CompletionUsage) -> dict[str, Any]:
    return _usage(usage).dump()


def _extras(message: Any, *, include_usage: bool, debug: bool) -> dict[str, Any]:
    """The response's optional tail: `usage` (null when asked for but not yet known) and
    `debug`; an absent key stays absent."""
    fields: dict[str, Any] = {}
    if message.HasField("usage"):
        fields["usage"] = _usage(message.usage)
    elif include_usage:
        fields["usage"] = None
    if debug and message.HasField("times"):
        fields["debug"] = _debug(message.times)
    return fields


def _debug(times: common_pb2.StageTimes) -> out.Debug:
    """Where a request's time went, when the client asked (``X-Tokenline-Debug``): the
    stamps and each stage in milliseconds, on a whole response or a finish chunk."""
    return out.Debug(
        times=json_format.MessageToDict(times, preserving_proto_field_name=True),
        stages_ms=stage_durations_ms(times),
    )


def _top_logprob(entry: openai_pb2.TopLogprobEntry) -> out.TopLogprob:
    return out.TopLogprob(
        token=entry.token,
        logprob=_finite(entry.logprob),
        bytes=_token_bytes(entry.token, entry.bytes),
    )


def _chat_logprobs(logprobs: openai_pb2.ChoiceLogprobs) -> out.ChatLogprobs:
    content = [
        out.TokenLogprob(
            token=e.token,
            logprob=_finite(e.logprob),
            bytes=_token_bytes(e.token, e.bytes),
            top_logprobs=[_top_logprob(t) for t in e.top_logprobs],
        )
        for e in logprobs.content
    ]
    return out.ChatLogprobs(content=content, refusal=None)


def _completion_logprobs(logprobs: openai_pb2.CompletionLogprobs) -> out.CompletionLogprobs:
    token_logprobs: list[float | None] = [_finite(x) for x in logprobs.token_logprobs]
    top_logprobs: list[dict[str, float] | None] = [
        {k: _finite(v) for k, v in json_format.MessageToDict(s).items()}
        for s in logprobs.top_logprobs
    ]
    if logprobs.is_first_null and token_logprobs:  # echo: the first prompt token
        token_logprobs[0] = top_logprobs[0] = None
    return out.CompletionLogprobs(
        tokens=list(logprobs.tokens),
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=list(logprobs.text_offset),
    )


def _prompt_logprobs(message: Any) -> dict[str, Any]:
    """vLLM's ``prompt_logprobs`` when the request asked (the proto then holds one entry
    per prompt token): null for the first token, else ``{token id: Logprob}`` for the
    prompt's token (its own rank) and each alternative (ranked 1..N)."""
    entries: list[dict[str, out.PromptLogprob] | None] = []
    for e in message.prompt_logprobs:
        if e.no_logprob:
            entries.append(None)
            continue
        mine = out.PromptLogprob(logprob=_finite(e.logprob), rank=e.rank, decoded_token=e.text)
        entry = {str(e.token_id): mine}
        for rank, top in enumerate(e.top, start=1):
            alt = out.PromptLogprob(logprob=_finite(top.logprob), rank=rank, decoded_token=top.text)
            entry.setdefault(str(top.token_id), alt)
        entries.append(entry)
    return {"prompt_logprobs": entries} if entries else {}


def _token_ids(message: Any, *names: str) -> dict[str, Any]:
    """vLLM's return_token_ids lists: the frontend fills them only when asked, and a
    prompt or a new chunk of output is never empty, so an empty list means "not asked"."""
    return {name: list(getattr(message, name)) for name in names if len(getattr(message, name))}


def _has_logprobs(choice: Any, requested: bool) -> bool:
    """Logprobs are written (else null) only when the request asked for them."""
    return requested and choice.HasField("logprobs")


def _tool_call(call: openai_pb2.ToolCall) -> out.ToolCall:
    function = out.ToolCallFunction(name=call.function.name, arguments=call.function.arguments)
    return out.ToolCall(id=call.id, type=call.type or "function", function=function)


def _tool_call_delta(call: openai_pb2.ToolCall) -> out.ToolCallDelta:
    """Only the parts that are new: `name`, `id` and `type` when the frontend sent them."""
    function = out.ToolCallFunctionDelta(arguments=call.function.arguments)
    if call.function.name:
        function.name = call.function.name
    delta = out.ToolCallDelta(index=call.index, function=function)
    if call.id:
        delta.id = call.id
    if call.type:
        delta.type = call.type
    return delta


def _reasoning(message: Any) -> dict[str, Any]:
    """Under both names: ``reasoning_content`` (DeepSeek, SGLang, older vLLM) and
    ``reasoning`` (vLLM's newer name); nothing when the proto has none."""
    if not message.HasField("reasoning_content"):
        return {}
    text = message.reasoning_content
    return {"reasoning_content": text, "reasoning": text}


def _delta(delta: openai_pb2.ChatDelta) -> out.ChatDelta:
    fields = _reasoning(delta)
    for name in ("role", "content"):
        if delta.HasField(name):
            fields[name] = getattr(delta, name)
    if delta.tool_calls:
        fields["tool_calls"] = [_tool_call_delta(c) for c in delta.tool_calls]
    return out.ChatDelta(**fields)


def chat_chunk(
    chunk: openai_pb2.ChatCompletionChunk,
    *,
    include_usage: bool,
    logprobs: bool,
    debug: bool = False,
) -> out.ChatCompletionChunk:
    """One `chat.completion.chunk` SSE payload (the stream writes the model straight to JSON)."""
    choices = [
        out.ChatChunkChoice(
            index=c.index,
            delta=_delta(c.delta),
            logprobs=_chat_logprobs(c.logprobs) if _has_logprobs(c, logprobs) else None,
            finish_reason=_optional(c, "finish_reason"),
            stop_reason=_matched_stop(c),
            **_token_ids(c, "token_ids"),
        )
        for c in chunk.choices
    ]
    return out.ChatCompletionChunk(
        id=chunk.id,
        object="chat.completion.chunk",
        created=_created(chunk),
        model=chunk.model,
        choices=choices,
        **_extras(chunk, include_usage=include_usage, debug=debug),
        **_token_ids(chunk, "prompt_token_ids"),
    )


def _response_message(message: openai_pb2.ChatResponseMessage) -> out.ChatMessage:
    fields = _reasoning(message)
    if message.tool_calls:
        fields["tool_calls"] = [_tool_call(c) for c in message.tool_calls]
    return out.ChatMessage(
        role=message.role or "assistant",
        content=_optional(message, "content"),
        refusal=None,
        **fields,
    )


def chat_completion_to_dict(
    completion: openai_pb2.ChatCompletion, *, logprobs: bool, debug: bool = False
) -> dict[str, Any]:
    """The non-streamed `chat.completion` object."""
    choices = [
        out.ChatChoice(
            index=c.index,
            message=_response_message(c.message),
            logprobs=_chat_logprobs(c.logprobs) if _has_logprobs(c, logprobs) else None,
            finish_reason=c.finish_reason or None,
            stop_reason=_matched_stop(c),
            **_token_ids(c, "token_ids"),
        )
        for c in completion.choices
    ]
    extras = _extras(completion, include_usage=True, debug=debug) | _prompt_logprobs(completion)
    extras |= _token_ids(completion, "prompt_token_ids")
    return out.ChatCompletion(
        id=completion.id,
        object="chat.completion",
        created=_created(completion),
        model=completion.model,
        choices=choices,
        usage=extras.pop("usage"),
        **extras,
    ).dump()


def completion_to_dict(
    completion: openai_pb2.Completion | openai_pb2.CompletionChunk,
    *,
    include_usage: bool,
    logprobs: bool,
    debug: bool = False,
) -> dict[str, Any]:
    """A `text_completion` object: the whole response or one streamed chunk."""
    model = text_completion(completion, include_usage=include_usage, logprobs=logprobs, debug=debug)
    return model.dump()


def text_completion(
    completion: openai_pb2.Completion | openai_pb2.CompletionChunk,
    *,
    include_usage: bool,
    logprobs: bool,
    debug: bool = False,
) -> out.Completion:
    """``completion_to_dict``'s model: the stream writes it straight to JSON."""
    choices = [
        out.CompletionChoice(
            index=c.index,
            text=c.text,
            logprobs=_completion_logprobs(c.logprobs) if _has_logprobs(c, logprobs) else None,
            finish_reason=_optional(c, "finish_reason"),
            stop_reason=_matched_stop(c),
            **_prompt_logprobs(c),
            **_token_ids(c, "token_ids", "prompt_token_ids"),
        )
        for c in completion.choices
    ]
    return out.Completion(
        id=completion.id,
        object="text_completion",
        created=_created(completion),
        model=completion.model,
        choices=choices,
        **_extras(completion, include_usage=include_usage, debug=debug),
    )


def _model(model: openai_pb2.Model) -> out.Model:
    fields: dict[str, Any] = {}
    if model.max_model_len:
        fields["max_model_len"] = model.max_model_len
    if model.dtype:
        fields["dtype"] = model.dtype
    if model.model_impl:  # reported together with the architecture
        fields["architecture"] = model.architecture
        fields["model_impl"] = model.model_impl
    return out.Model(
        id=model.id,
        object="model",
        created=model.created,
        owned_by=model.owned_by or "tokenline",
        **fields,
    )


def model_to_dict(model: openai_pb2.Model) -> dict[str, Any]:
    return _model(model).dump()


def model_list_to_dict(models: openai_pb2.ModelList) -> dict[str, Any]:
    return out.ModelList(object="list", data=[_model(m) for m in models.data]).dump()


def embedding_list_to_dict(response: embeddings_pb2.EmbeddingResponse) -> dict[str, Any]:
    """OpenAI's embedding list: each vector as floats, or as its little-endian float32
    bytes in base64 when the request asked for that (the frontend filled the bytes)."""
    data = [
        out.EmbeddingObject(
            object="embedding",
            index=d.index,
            embedding=(
                base64.b64encode(d.embedding_bytes).decode("ascii")
                if d.embedding_bytes
                else list(d.embedding)
            ),
        )
        for d in response.data
    ]
    usage = out.EmbeddingUsage(
        prompt_tokens=response.usage.prompt_tokens, total_tokens=response.usage.total_tokens
    )
    return out.EmbeddingList(
        id=response.id,
        object="list",
        created=response.created,
        model=response.model,
        data=data,
        usage=usage,
    ).dump()
