"""Anthropic Messages request bodies as the gateway accepts them.

Types are checked here; what a block may hold for its role, and which block types are
refused, is ``convert.py``'s job, so that a refusal names the block and its type. Fields
not declared here go through ``gateway/extra_fields.py`` like any body's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# Anthropic's prompt-caching mark, accepted wherever Anthropic takes it: tokenline's
# prefix cache reuses any shared prefix without marks, so it changes nothing.
def _cache_control() -> Any:
    return Field(default=None, description="accepted; the prefix cache needs no marks")


class ContentBlockBody(_Body):
    """One block of any type: text, tool_use or tool_result (others are refused by name)."""

    type: str = Field(description='"text" | "tool_use" | "tool_result"')
    text: str | None = None
    id: str | None = Field(default=None, description="tool_use: the call's id")
    name: str | None = Field(default=None, description="tool_use: the tool called")
    input: dict[str, Any] | None = Field(default=None, description="tool_use: the call's arguments")
    tool_use_id: str | None = Field(default=None, description="tool_result: the call it answers")
    content: str | list[ContentBlockBody] | None = Field(
        default=None, description="tool_result: text or text blocks"
    )
    is_error: bool | None = Field(default=None, description="tool_result: the call failed")
    cache_control: dict[str, Any] | None = _cache_control()


class MessageParamBody(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockBody]


class ToolParamBody(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON Schema")
    type: str | None = Field(
        default=None, description='"custom" or absent; server tools are refused'
    )
    cache_control: dict[str, Any] | None = _cache_control()


class ToolChoiceBody(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, description='type "tool": the tool to call')
    disable_parallel_tool_use: bool | None = None


class ThinkingBody(_Body):
    type: str = Field(description='only "disabled" is accepted')


class MessagesBody(_Body):
    """``POST /v1/messages``."""

    model: str = ""
    max_tokens: int = Field(description="required, as Anthropic requires it")
    messages: list[MessageParamBody]
    system: str | list[ContentBlockBody] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolParamBody] | None = None
    tool_choice: ToolChoiceBody | None = None
    thinking: ThinkingBody | None = None
    cache_control: dict[str, Any] | None = _cache_control()
