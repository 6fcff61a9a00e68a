"""``POST /v1/responses`` request bodies as the gateway accepts them.

Types are checked here; what an item may hold for its type and which types are refused is
the frontend's job (``services/frontend/serving/responses_input.py``), so a gRPC client
gets the same answers. Fields not declared here go through ``gateway/extra_fields.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def _ignored(what: str) -> Any:
    return Field(default=None, description=f"accepted; {what}")


class InputContentBody(_Body):
    type: str = Field(description='"input_text" | "output_text"; other types are refused')
    text: str | None = None
    annotations: list[Any] | None = _ignored("an earlier output's annotations are not rendered")
    logprobs: list[Any] | None = _ignored("an earlier output's logprobs are not rendered")


class InputItemBody(_Body):
    """A message (``type`` "message" or absent), or a function call and its output."""

    type: str = Field("message", description='"message" | "function_call" | "function_call_output"')
    role: str | None = Field(None, description="message: user | assistant | system | developer")
    content: str | list[InputContentBody] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = Field(None, description="function_call: JSON text")
    output: str | None = Field(None, description="function_call_output: the call's result")
    id: str | None = Field(
        None, description="an earlier output item's id: kept as the item's id in input_items"
    )
    status: str | None = _ignored("an earlier output item's status")


class FunctionToolBody(_Body):
    type: Literal["function"] = Field(description='only "function" tools are served')
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema")
    strict: bool | None = Field(
        None, description="true needs tool_choice 'required' or a named function (the grammar)"
    )


class TextFormatBody(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextBody(_Body):
    format: TextFormatBody | None = None


class ReasoningBody(_Body):
    effort: str | None = Field(None, description="handed to the chat template")


class ResponsesBody(_Body):
    """``POST /v1/responses``."""

    model: str = ""
    input: str | list[InputItemBody]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionToolBody] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextBody | None = None
    reasoning: ReasoningBody | None = None
    stream: bool = False
    user: str | None = None
    seed: int | None = Field(None, description="not OpenAI's: the sampling seed (vLLM's extra)")
    store: bool | None = Field(
        None,
        description="default true: kept on the frontend (bounded, expiring)",
    )
    previous_response_id: str | None = Field(
        None, description="continue this stored response; 404 naming it when unknown or expired"
    )
    background: bool | None = Field(
        None,
        description="run detached: answered `in_progress` once dispatched; poll GET, cancel "
        "with POST .../cancel. Needs `store` (not false), not with `stream`",
    )
