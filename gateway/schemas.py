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
    # Structured output: at most one of these (see the README's table).
    response_format: ResponseFormatBody | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = Field(None, description="vLLM: a JSON Schema")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = Field(None, description="vLLM: EBNF")


class ChatCompletionBody(SharedRequestBody):
    model: str = ""
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = Field(None, description="preferred over max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolBody] | None = None
    tool_choice: str | dict[str, Any] | None = Field(None, description='"none" | "auto" | ...')
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = Field(
        None, description="handed to the chat template as the variable `reasoning_effort`"
    )


class CompletionBody(SharedRequestBody):
    model: str = ""
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids, or lists of token ids"
    )
    logprobs: int | None = Field(None, description="number of top logprobs per token")
    echo: bool = False
    suffix: str | None = None


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


class TokenizeBody(_Body):
    model: str = ""
    prompt: str
    add_special_tokens: bool = True


class DetokenizeBody(_Body):
    model: str = ""
    tokens: list[int]
