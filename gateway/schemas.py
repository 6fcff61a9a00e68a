"""Request bodies as the gateway accepts them (they drive /openapi.json).

Types are checked here (a wrong type is a 400 naming the field); value ranges are
the frontend's job, so the rules live in one place. Fields not declared here are kept
aside (``model_extra``) for ``gateway/extra_fields.py``, which accepts harmless
metadata and refuses the rest by name.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    # Unknown fields are kept aside and ignored; NaN/Infinity are refused as values.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ContentPartBody(_Body):
    type: str = Field(description='"text"; other part types are refused by the frontend')
    text: str | None = None


class ToolCallFunctionBody(_Body):
    name: str = ""
    arguments: str = Field("", description="JSON text, as OpenAI sends it")


class ToolCallBody(_Body):
    id: str = ""
    type: str = "function"
    function: ToolCallFunctionBody
    index: int | None = None


class ChatMessageBody(_Body):
    role: str = Field(description="system | developer | user | assistant | tool")
    content: str | list[ContentPartBody] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionBody(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema")


class ToolBody(_Body):
    type: str = "function"
    function: FunctionBody


class StreamOptionsBody(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaBody(_Body):
    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema")
    strict: bool | None = Field(
        None, description="accepted either way: the output always follows the schema"
    )


class ResponseFormatBody(_Body):
    type: str = Field(description='"text" | "json_object" | "json_schema"')
    json_schema: JsonSchemaBody | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs``: one member at most."""

    json_: str | dict[str, Any] | None = Field(None, alias="json", description="a JSON Schema")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="EBNF (xgrammar / GBNF)")
    json_object: bool | None = None


class SamplingFieldsBody(_Body):
    """The sampling fields every generation body shares, under the same names: OpenAI's,
    vLLM's and SGLang's. Each body adds its own length limits and structured output."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) → bias")
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None


class SharedRequestBody(SamplingFieldsBody):
    """What chat and completions share: sampling (OpenAI + vLLM/SGLang extras), streaming."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptionsBody | None = None
    user: str | None = None
    # Structured output: at most one of these (docs/structured-output.md has the table).
    response_format: ResponseFormatBody | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = Field(None, description="vLLM: a JSON Schema")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = Field(None, description="vLLM: EBNF")
    # vLLM's extras (docs/api.md, "vLLM's request semantics").
    include_stop_str_in_output: bool | None = Field(
        None, description="vLLM's name for no_stop_trim: keep the matched stop in the text"
    )
    truncate_prompt_tokens: int | None = Field(
        None, description="keep the prompt's last N tokens; -1: as many as fit"
    )
    priority: int | None = Field(None, description="lower runs earlier (vLLM); default 0")
    return_token_ids: bool | None = Field(
        None, description="add prompt_token_ids and each choice's token_ids"
    )
    prompt_logprobs: int | None = Field(
        None, description="vLLM: logprobs of every prompt token, with this many alternatives"
    )


class ChatCompletionBody(SharedRequestBody):
    model: str = ""
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = Field(None, description="preferred over max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolBody] | None = None
    tool_choice: str | dict[str, Any] | None = Field(None, description='"none" | "auto" | ...')
    parallel_tool_calls: bool | None = Field(
        None, description='false: tool_choice "required" makes exactly one call'
    )
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = Field(
        None, description="handed to the chat template as the variable `reasoning_effort`"
    )
    add_special_tokens: bool | None = Field(
        None, description="BOS etc. on top of what the chat template writes (default false)"
    )


class CompletionBody(SharedRequestBody):
    model: str = ""
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids, or lists of token ids"
    )
    logprobs: int | None = Field(None, description="number of top logprobs per token")
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool | None = Field(
        None, description="the tokenizer's BOS etc. on text prompts (default true)"
    )


class EmbeddingsBody(_Body):
    """`POST /v1/embeddings`."""

    model: str = ""
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids, or lists of token ids; none may be empty"
    )
    encoding_format: str | None = Field(None, description='"float" (default) | "base64"')
    dimensions: int | None = Field(
        None, description="refused unless the model's hidden size (no truncation)"
    )
    user: str | None = None
    normalize: bool | None = Field(
        None, description="vLLM's: false returns the pooled state unnormalised (default true)"
    )


class GenerateSamplingBody(SamplingFieldsBody):
    """`SamplingParams` (proto/tokenline/v1/common.proto) in SGLang's JSON names."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    # SGLang's structured output: at most one.
    json_schema: str | dict[str, Any] | None = Field(None, description="a JSON Schema")
    regex: str | None = None
    ebnf: str | None = Field(None, description="EBNF (xgrammar / GBNF)")


class TokenIdsBody(_Body):
    ids: list[int]


class LogprobOptionsBody(_Body):
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int | None = Field(
        None, description="prompt logprobs from this position on; -1 or unset: none"
    )
    prompt_top_logprobs_num: int | None = Field(
        None, description="alternatives per prompt position; unset: top_logprobs_num"
    )


class SessionParamsBody(_Body):
    """`SessionParams` (proto/tokenline/v1/session.proto): continue a request of a session."""

    id: str = Field(description="the session, as /open_session returned it")
    rid: str | None = Field(None, description="the request to continue: its meta_info.id")
    offset: int | None = Field(None, description="keep the parent's first N ids (0: all)")
    replace: bool | None = Field(None, description="drop the parent's other continuations")
    drop_previous_output: bool | None = Field(None, description="continue the parent's prompt")


class OpenSessionBody(_Body):
    """SGLang's /open_session."""

    capacity_of_str_len: int = Field(
        ge=1, lt=2**32, description="the most tokens a request of the session may hold"
    )
    session_id: str | None = Field(None, description="default: a new id")


class CloseSessionBody(_Body):
    session_id: str


class GenerateBody(_Body):
    """`GenerateReqInput` as proto JSON, plus SGLang's shorthands (single values, flat flags)."""

    rid: str | None = Field(None, description="defaults to the request id")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | list[TokenIdsBody] | None = None
    sampling_params: GenerateSamplingBody | None = None
    stream: bool = False
    logprob: LogprobOptionsBody | None = None
    return_logprob: bool | None = Field(None, description="shorthand for logprob.return_logprob")
    top_logprobs_num: int | None = Field(None, description="shorthand for logprob.top_logprobs_num")
    logprob_start_len: int | None = Field(
        None, description="shorthand for logprob.logprob_start_len"
    )
    return_text_in_logprobs: bool = Field(
        False, description="each logprob triple carries the token's text (else null)"
    )
    session_params: SessionParamsBody | None = None


class TokenizeBody(_Body):
    """vLLM's two tokenize requests in one body: `prompt`, or chat `messages` templated as
    a chat request would be."""

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    add_special_tokens: bool | None = Field(
        None, description="default true for `prompt`; with `messages` only false is accepted"
    )
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    tools: list[ToolBody] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    model: str = ""
    tokens: list[int]


class AbortBody(_Body):
    """SGLang's /abort_request."""

    rid: str = Field("", description="a client id (as in meta_info.id) or a request's rid")
    abort_all: bool = False
