"""The one definition of each JSON response shape: gateway/render.py builds these models
from the protos, and /openapi.json documents the same models, so the two cannot drift.

A required field is always written (``null`` where the type allows it); a field with a
default is written only when render.py sets it (``dump`` drops unset fields), which is
how OpenAI's present-but-null keys differ from its absent ones. Every model forbids
extra keys. The native `/generate` body is proto JSON (its shape is generate.proto's);
its models here only document it and let extra keys pass.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def dump(self) -> dict[str, Any]:
        """The JSON body: every field render.py set (``None`` → null), no others."""
        return self.model_dump(exclude_unset=True)


# ---- errors --------------------------------------------------------------------------


class ErrorObject(_Out):
    message: str
    type: str = Field(description="follows the HTTP status, e.g. invalid_request_error")
    param: str | None = Field(description="the request field at fault, when one is")
    code: str | None = Field(description="the gRPC status name in lower case, or a gateway code")


class ErrorResponse(_Out):
    """Every failure, whatever the status; a stream that fails mid-way sends it as a frame."""

    error: ErrorObject


# ---- shared pieces -------------------------------------------------------------------


class PromptTokensDetails(_Out):
    cached_tokens: int


class CompletionTokensDetails(_Out):
    reasoning_tokens: int = Field(description="completion tokens up to the end of reasoning")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="only when the frontend runs a --reasoning-parser"
    )


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob]
    refusal: None


StopReason = int | str | None
_STOP_REASON = Field(description="the stop string or token id that ended the choice (vLLM)")


class ToolCallFunction(_Out):
    name: str
    arguments: str


class ToolCall(_Out):
    id: str
    type: str
    function: ToolCallFunction


class Debug(_Out):
    """A request's stamps (see StageTimes) and its stages in milliseconds."""

    times: dict[str, float]
    stages_ms: dict[str, float]


_DEBUG = Field(
    None,
    description="only with header `X-Tokenline-Debug: 1`: on the response, or on each "
    "choice's finish chunk when streaming",
)


class _Header(_Out):
    id: str
    object: str  # each response narrows it to its Literal, in this position
    created: int
    model: str


# ---- chat ----------------------------------------------------------------------------


class ChatMessage(_Out):
    role: str
    content: str | None
    refusal: None
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="the same as reasoning_content")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Out):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason = _STOP_REASON


class ChatCompletion(_Header):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage | None = Field(description="null only if the frontend reported none")
    debug: Debug | None = _DEBUG


class ToolCallFunctionDelta(_Out):
    name: str | None = None
    arguments: str


class ToolCallDelta(_Out):
    index: int
    id: str | None = None
    type: str | None = None
    function: ToolCallFunctionDelta


class ChatDelta(_Out):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="the same as reasoning_content")
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason = _STOP_REASON


class ChatCompletionChunk(_Header):
    """One SSE `data:` frame. `usage` is present only with `stream_options.include_usage`:
    null on every chunk but the last, which has `choices: []`."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    debug: Debug | None = _DEBUG


# ---- completions ---------------------------------------------------------------------


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason = _STOP_REASON


class Completion(_Header):
    """The whole response, or (streaming) one SSE `data:` frame with the same shape;
    a streamed frame carries `usage` only as ChatCompletionChunk does."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None
    debug: Debug | None = _DEBUG


# ---- models, native, ops -------------------------------------------------------------


class Model(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None
    dtype: str | None = Field(
        None,
        description="what the schedulers run the model in, e.g. bfloat16 "
        "(comma-joined when replicas differ)",
    )


class ModelList(_Out):
    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Out):
    prompt: str


class _ProtoJson(BaseModel):
    # Proto JSON grows when a proto gains a field (additions only), so extra keys pass.
    model_config = ConfigDict(extra="allow")


class FinishReason(_ProtoJson):
    kind: Literal["KIND_UNSPECIFIED", "KIND_STOP", "KIND_LENGTH", "KIND_ABORT"]
    matched_token_id: int | None = None
    matched_str: str | None = None
    message: str


class StageTimes(_ProtoJson):
    """Unix seconds (doubles); 0 for a stage the request has not reached."""

    received: float
    templated: float
    tokenized: float
    dispatched: float
    scheduled: float
    first_token: float
    finished: float
    queued: float
    detokenized: float


class MetaInfo(_ProtoJson):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    times: StageTimes | None = None


class NativeTopLogprob(_ProtoJson):
    token_id: int
    logprob: float


class NativeTokenLogprob(NativeTopLogprob):
    top: list[NativeTopLogprob]


class GenerateOutput(_ProtoJson):
    rid: str
    index: int
    text: str = Field(description="the full text (unary) or the delta (one stream frame)")
    output_ids: list[int]
    finish_reason: FinishReason | None = Field(None, description="on the final output only")
    meta_info: MetaInfo | None = None
    logprobs: list[NativeTokenLogprob]


class GenerateResponse(_ProtoJson):
    """`GenerateResponse` (proto/tokenline/v1/generate.proto) as proto JSON: snake_case
    names, every scalar printed; a stream sends one per SSE frame, in input order."""

    outputs: list[GenerateOutput]


class HealthResponse(_Out):
    status: Literal["ok"]
