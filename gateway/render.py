"""Response protos → JSON dicts shaped exactly as OpenAI's API returns them.

Proto3 cannot say "null", so the OpenAI nulls are decided here: `finish_reason`
is null until a choice ends, `logprobs` is null unless asked for, and with
`include_usage` every chunk but the last carries `"usage": null`.
"""

from __future__ import annotations

import math
import time
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from tokenline.v1 import common_pb2, generate_pb2, openai_pb2

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


def usage_to_dict(usage: openai_pb2.CompletionUsage) -> dict[str, Any]:
    details = usage.prompt_tokens_details
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": (
            {"cached_tokens": details.cached_tokens}
            if usage.HasField("prompt_tokens_details")
            else None
        ),
    }
    if usage.HasField("completion_tokens_details"):  # only with a reasoning parser
        reasoning = usage.completion_tokens_details.reasoning_tokens
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def _put_usage(out: dict[str, Any], message: Message, include_usage: bool) -> None:
    if message.HasField("usage"):
        out["usage"] = usage_to_dict(message.usage)
    elif include_usage:
        out["usage"] = None


def _chat_logprobs(logprobs: openai_pb2.ChoiceLogprobs) -> dict[str, Any]:
    content = [
        {
            "token": e.token,
            "logprob": _finite(e.logprob),
            "bytes": _token_bytes(e.token, e.bytes),
            "top_logprobs": [
                {
                    "token": t.token,
                    "logprob": _finite(t.logprob),
                    "bytes": _token_bytes(t.token, t.bytes),
                }
                for t in e.top_logprobs
            ],
        }
        for e in logprobs.content
    ]
    return {"content": content, "refusal": None}


def _maybe_logprobs(choice: Message, requested: bool) -> dict[str, Any] | None:
    if not (requested and choice.HasField("logprobs")):
        return None
    logprobs = choice.logprobs
    if isinstance(logprobs, openai_pb2.CompletionLogprobs):
        return _completion_logprobs(logprobs)
    return _chat_logprobs(logprobs)


def _tool_call(call: openai_pb2.ToolCall, *, is_delta: bool) -> dict[str, Any]:
    """Deltas carry `index` and only the parts that are new; full messages carry all."""
    function: dict[str, Any] = {"arguments": call.function.arguments}
    if call.function.name or not is_delta:
        function["name"] = call.function.name
    out: dict[str, Any] = {"index": call.index} if is_delta else {}
    if call.id or not is_delta:
        out["id"] = call.id
    if call.type or not is_delta:
        out["type"] = call.type or "function"
    out["function"] = function
    return out


def _delta(delta: openai_pb2.ChatDelta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in ("role", "content"):
        if delta.HasField(field):
            out[field] = getattr(delta, field)
    if delta.HasField("reasoning_content"):
        _put_reasoning(out, delta.reasoning_content)
    if delta.tool_calls:
        out["tool_calls"] = [_tool_call(c, is_delta=True) for c in delta.tool_calls]
    return out


def chat_chunk_to_dict(
    chunk: openai_pb2.ChatCompletionChunk,
    *,
    include_usage: bool,
    logprobs: bool,
    debug: bool = False,
) -> dict[str, Any]:
    """One `chat.completion.chunk` SSE payload."""
    choices = [
        {
            "index": c.index,
            "delta": _delta(c.delta),
            "logprobs": _maybe_logprobs(c, logprobs),
            "finish_reason": _optional(c, "finish_reason"),
            "stop_reason": _matched_stop(c),
        }
        for c in chunk.choices
    ]
    out = _header(chunk, "chat.completion.chunk") | {"choices": choices}
    _put_usage(out, chunk, include_usage)
    _put_debug(out, chunk, debug)
    return out


def _put_reasoning(out: dict[str, Any], text: str) -> None:
    """Under both names: ``reasoning_content`` (DeepSeek, SGLang, older vLLM) and
    ``reasoning`` (vLLM's newer name)."""
    out["reasoning_content"] = out["reasoning"] = text


def _response_message(message: openai_pb2.ChatResponseMessage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": message.role or "assistant",
        "content": _optional(message, "content"),
        "refusal": None,
    }
    if message.HasField("reasoning_content"):
        _put_reasoning(out, message.reasoning_content)
    if message.tool_calls:
        out["tool_calls"] = [_tool_call(c, is_delta=False) for c in message.tool_calls]
    return out


def chat_completion_to_dict(
    completion: openai_pb2.ChatCompletion, *, logprobs: bool, debug: bool = False
) -> dict[str, Any]:
    """The non-streamed `chat.completion` object."""
    choices = [
        {
            "index": c.index,
            "message": _response_message(c.message),
            "logprobs": _maybe_logprobs(c, logprobs),
            "finish_reason": c.finish_reason or None,
            "stop_reason": _matched_stop(c),
        }
        for c in completion.choices
    ]
    out = _header(completion, "chat.completion") | {"choices": choices}
    _put_usage(out, completion, include_usage=True)
    _put_debug(out, completion, debug)
    return out


def _completion_logprobs(logprobs: openai_pb2.CompletionLogprobs) -> dict[str, Any]:
    return {
        "tokens": list(logprobs.tokens),
        "token_logprobs": [_finite(x) for x in logprobs.token_logprobs],
        "top_logprobs": [
            {k: _finite(v) for k, v in json_format.MessageToDict(s).items()}
            for s in logprobs.top_logprobs
        ],
        "text_offset": list(logprobs.text_offset),
    }


def completion_to_dict(
    completion: openai_pb2.Completion | openai_pb2.CompletionChunk,
    *,
    include_usage: bool,
    logprobs: bool,
    debug: bool = False,
) -> dict[str, Any]:
    """A `text_completion` object: the whole response or one streamed chunk."""
    choices = [
        {
            "index": c.index,
            "text": c.text,
            "logprobs": _maybe_logprobs(c, logprobs),
            "finish_reason": _optional(c, "finish_reason"),
            "stop_reason": _matched_stop(c),
        }
        for c in completion.choices
    ]
    out = _header(completion, "text_completion") | {"choices": choices}
    _put_usage(out, completion, include_usage)
    _put_debug(out, completion, debug)
    return out


def _header(message: Any, object_name: str) -> dict[str, Any]:
    return {
        "id": message.id,
        "object": message.object or object_name,
        "created": message.created or int(time.time()),
        "model": message.model,
    }


def model_to_dict(model: openai_pb2.Model) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": model.id,
        "object": model.object or "model",
        "created": model.created,
        "owned_by": model.owned_by or "tokenline",
    }
    if model.max_model_len:
        out["max_model_len"] = model.max_model_len
    if model.dtype:
        out["dtype"] = model.dtype
    return out


def model_list_to_dict(models: openai_pb2.ModelList) -> dict[str, Any]:
    return {"object": models.object or "list", "data": [model_to_dict(m) for m in models.data]}


def generate_to_dict(response: generate_pb2.GenerateResponse) -> dict[str, Any]:
    """Native responses are proto JSON with the proto's own (snake_case) field names."""
    return json_format.MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _put_debug(out: dict[str, Any], message: Any, debug: bool) -> None:
    """Where a request's time went, when the client asked (``X-Tokenline-Debug``): the
    stamps and each stage in milliseconds, on a whole response or a finish chunk."""
    if not debug or not message.HasField("times"):
        return
    times: common_pb2.StageTimes = message.times
    out["debug"] = {
        "times": json_format.MessageToDict(times, preserving_proto_field_name=True),
        "stages_ms": stage_durations_ms(times),
    }
