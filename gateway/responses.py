"""The one definition of each JSON response shape: gateway/render/openai.py builds these models
from the protos, and /openapi.json documents the same models, so the two cannot drift.

A required field is always written (``null`` where the type allows it); a field with a
default is written only when render/openai.py sets it (``dump`` drops unset fields), which is
how OpenAI's present-but-null keys differ from its absent ones. Every model forbids
extra keys. The native `/generate` body is SGLang's shape (gateway/render/generate.py);
gRPC and Envoy clients get the typed `GenerateResponse` proto instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel


class JsonBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def dump(self) -> dict[str, Any]:
        """The JSON body: every field render/openai.py set (``None`` → null), no others."""
        return self.model_dump(exclude_unset=True)

    def dump_json(self) -> bytes:
        """``dump()`` as UTF-8 JSON, serialised by pydantic-core in one call: a streamed
        frame is written this way, 2 µs where ``json.dumps(dump())`` took 6."""
        return self.__pydantic_serializer__.to_json(self, exclude_unset=True)


# ---- errors --------------------------------------------------------------------------


class ErrorObject(JsonBody):
    message: str
    type: str = Field(description="follows the HTTP status, e.g. invalid_request_error")
    param: str | None = Field(description="the request field at fault, when one is")
    code: str | None = Field(description="the gRPC status name in lower case, or a gateway code")


class ErrorResponse(JsonBody):
    """Every failure, whatever the status; a stream that fails mid-way sends it as a frame."""

    error: ErrorObject


# ---- shared pieces -------------------------------------------------------------------


class PromptTokensDetails(JsonBody):
    cached_tokens: int


class CompletionTokensDetails(JsonBody):
    reasoning_tokens: int = Field(description="completion tokens up to the end of reasoning")


class Usage(JsonBody):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="only when the frontend runs a --reasoning-parser"
    )


class TopLogprob(JsonBody):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(JsonBody):
    content: list[TokenLogprob]
    refusal: None


StopReason = int | str | None
_STOP_REASON = Field(
    description="the stop string or token id that ended the choice (vLLM); null for the "
    "model's EOS, a length finish, or none yet"
)
_TOKEN_IDS = Field(
    None,
    description="with return_token_ids (vLLM): the output token ids (a stream: this "
    "chunk's new ones)",
)
_PROMPT_TOKEN_IDS = Field(
    None, description="with return_token_ids (vLLM): the prompt's ids (a stream: first chunk)"
)


class ToolCallFunction(JsonBody):
    name: str
    arguments: str


class ToolCall(JsonBody):
    id: str
    type: str
    function: ToolCallFunction


class Debug(JsonBody):
    """A request's stamps (see StageTimes) and its stages in milliseconds."""

    times: dict[str, float]
    stages_ms: dict[str, float]


_DEBUG = Field(
    None,
    description="only with header `X-Tokenline-Debug: 1`: on the response, or on each "
    "choice's finish chunk when streaming",
)


class _Header(JsonBody):
    id: str
    object: str  # each response narrows it to its Literal, in this position
    created: int
    model: str


# ---- chat ----------------------------------------------------------------------------


class ChatMessage(JsonBody):
    role: str
    content: str | None
    refusal: None
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="the same as reasoning_content")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(JsonBody):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason = _STOP_REASON
    token_ids: list[int] | None = _TOKEN_IDS


class PromptLogprob(JsonBody):
    """vLLM's Logprob, in a prompt_logprobs entry."""

    logprob: float
    rank: int = Field(description="1 + the tokens the model scored higher")
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
_PROMPT_LOGPROBS = Field(
    None,
    description="vLLM's prompt_logprobs: per prompt token (null for the first), the token "
    "and its top alternatives keyed by token id; only when asked for",
)


class ChatCompletion(_Header):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage | None = Field(description="null only if the frontend reported none")
    debug: Debug | None = _DEBUG
    prompt_logprobs: PromptLogprobs | None = _PROMPT_LOGPROBS
    prompt_token_ids: list[int] | None = _PROMPT_TOKEN_IDS


class ToolCallFunctionDelta(JsonBody):
    name: str | None = None
    arguments: str


class ToolCallDelta(JsonBody):
    index: int
    id: str | None = None
    type: str | None = None
    function: ToolCallFunctionDelta


class ChatDelta(JsonBody):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="the same as reasoning_content")
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(JsonBody):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason = _STOP_REASON
    token_ids: list[int] | None = _TOKEN_IDS


class ChatCompletionChunk(_Header):
    """One SSE `data:` frame. `usage` is present only with `stream_options.include_usage`:
    null on every chunk but the last, which has `choices: []`."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    debug: Debug | None = _DEBUG
    prompt_token_ids: list[int] | None = _PROMPT_TOKEN_IDS


# ---- completions ---------------------------------------------------------------------


class CompletionLogprobs(JsonBody):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(
        description="null for the first prompt token (echo): nothing precedes it"
    )
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(JsonBody):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason = _STOP_REASON
    prompt_logprobs: PromptLogprobs | None = _PROMPT_LOGPROBS
    token_ids: list[int] | None = _TOKEN_IDS
    prompt_token_ids: list[int] | None = _PROMPT_TOKEN_IDS


class Completion(_Header):
    """The whole response, or (streaming) one SSE `data:` frame with the same shape;
    a streamed frame carries `usage` only as ChatCompletionChunk does."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None
    debug: Debug | None = _DEBUG


# ---- models, native, ops -------------------------------------------------------------


class Model(JsonBody):
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
    architecture: str | None = Field(
        None, description="the checkpoint's class, e.g. Olmo2ForCausalLM"
    )
    model_impl: str | None = Field(
        None,
        description="the path serving it: native (tokenline's model code) or transformers "
        "(the architecture's transformers code with tokenline's attention)",
    )


class ModelList(JsonBody):
    object: Literal["list"]
    data: list[Model]


# ---- native /generate (SGLang's shape) ----------------------------------------------

# SGLang's logprob triple: (logprob, token id, token text or null). The logprob is null
# only where there is none (SGLang: the first prompt token).
LogprobTriple = tuple[float | None, int, str | None]


class EmbeddingObject(JsonBody):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(
        description='floats, or with encoding_format "base64" little-endian float32 bytes in base64'
    )


class EmbeddingUsage(JsonBody):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(JsonBody):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingObject]
    usage: EmbeddingUsage


class GenerateFinishReason(JsonBody):
    """SGLang's finish reason: what matched for a stop (EOS or stop token id, or the stop
    string), the token count for a length stop, the reason for an abort."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = Field(description="null for length and abort")
    length: int | None = Field(default=None, description="length only: the tokens generated")
    message: str | None = Field(default=None, description="abort only: why")


class GenerateMetaInfo(JsonBody):
    id: str = Field(description="the client's id for this output (rid, or X-Request-Id)")
    finish_reason: GenerateFinishReason | None = Field(description="null until it finishes")
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = Field(
        default=None,
        description="prompt tokens found in the prefix cache; on a finished output only",
    )
    e2e_latency: float | None = Field(
        default=None, description="seconds; on a finished output only"
    )
    output_token_logprobs: list[LogprobTriple] | None = Field(
        default=None, description="with return_logprob: one triple per output token"
    )
    output_top_logprobs: list[list[LogprobTriple] | None] | None = Field(
        default=None, description="with return_logprob and top_logprobs_num > 0: per output token"
    )
    input_token_logprobs: list[LogprobTriple] | None = Field(
        default=None, description="with return_logprob, when the prompt's logprobs were computed"
    )
    input_top_logprobs: list[list[LogprobTriple] | None] | None = None


class GenerateOutput(JsonBody):
    """One prompt's (or choice's) output. Streaming sends one per SSE frame with the
    text, ids and logprobs so far (cumulative, SGLang's default), `index` when the
    request was a batch."""

    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo
    index: int | None = Field(default=None, description="stream frames of a batch only")


class GenerateResponse(RootModel[GenerateOutput | list[GenerateOutput]]):
    """`/generate`: one object for a single prompt, a list (input order, n choices per
    prompt) for a batch or n > 1, as SGLang answers."""


class TokenizeResponse(JsonBody):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = Field(default=None, description="only with return_token_strs")


class DetokenizeResponse(JsonBody):
    prompt: str


class VersionResponse(JsonBody):
    version: str


class ModelInfoResponse(JsonBody):
    """SGLang's /get_model_info keys, plus what tokenline knows of the served model."""

    model_path: str
    tokenizer_path: str
    is_generation: bool
    served_model_name: str
    dtype: str = Field(description="as the schedulers report it (empty before any lease)")
    max_model_len: int = Field(description="prompt plus output, as the schedulers enforce it")
    vocab_size: int
    architecture: str = Field("", description="the checkpoint's class, as the schedulers report")
    model_impl: str = Field("", description="the path serving it: native or transformers")


class ServiceInfo(JsonBody):
    """One service: where it is, its Prometheus scrape target, and its own GetInfo."""

    address: str
    metrics: str | None = Field(description="host:port of its /metrics (null: disabled)")
    info: dict[str, Any] | None = Field(description="its GetInfo; null when it did not answer")
    error: str | None = None
    is_leased: bool | None = Field(
        default=None, description="schedulers: this frontend's lease is up"
    )


class ServerInfoResponse(JsonBody):
    """SGLang's /get_server_info, tokenline's way: each service's GetInfo in one body."""

    version: str
    model: ModelInfoResponse
    gateway: ServiceInfo
    frontend: ServiceInfo
    schedulers: list[ServiceInfo]
    detokenizer: ServiceInfo


class SchedulerFlushResponse(JsonBody):
    address: str
    flushed: bool
    num_running: int
    num_waiting: int


class FlushCacheResponse(JsonBody):
    """200 when every scheduler flushed; 400 (an ErrorResponse) when one refused."""

    success: bool
    schedulers: list[SchedulerFlushResponse]


class AbortResponse(JsonBody):
    num_aborted: int = Field(description="live requests an abort was sent for (0: none matched)")


class HealthResponse(JsonBody):
    status: Literal["ok"]
