"""One OpenAI Agents SDK run (``openai-agents``) with one function tool, on the gateway's
``/v1/responses`` of the shared live stack, through the SDK's ``OpenAIResponsesModel``.

The random default model never calls a tool by itself, so ``tool_choice`` names the tool
(the grammar forces the call, its arguments valid against the tool's strict schema), and
``tool_use_behavior="stop_on_first_tool"`` ends the run with the tool's result: one model
call, one tool call, a deterministic end. Tracing is off (no network here).
"""

from __future__ import annotations

from typing import Literal

import openai
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_responses import OpenAIResponsesModel

from services.launch import LocalStack
from tests.integration.forced_calls import BUDGET


async def test_an_agent_calls_its_tool_and_ends_with_its_result(
    stack: LocalStack, model_id: str, client: openai.OpenAI
) -> None:
    calls: list[str] = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET", "PST"]) -> str:
        """The current time in a time zone."""
        calls.append(zone)
        return f"12:00 {zone}"

    gateway = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    agent = Agent(
        name="clock",
        instructions="Tell the time with the tool.",
        tools=[get_time],
        model=OpenAIResponsesModel(model_id, gateway),
        model_settings=ModelSettings(tool_choice="get_time", max_tokens=BUDGET, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    result = await Runner.run(
        agent,
        "What time is it in Berlin?",
        max_turns=2,
        run_config=RunConfig(tracing_disabled=True),
    )
    await gateway.close()
    assert len(calls) == 1 and calls[0] in ("UTC", "CET", "PST")
    assert result.final_output == f"12:00 {calls[0]}"
    [response] = result.raw_responses
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_time"  # type: ignore[union-attr]
    # The response the agent got is stored: its input is the agent's turn.
    stored = client.responses.retrieve(result.last_response_id or "")
    assert (
        stored.instructions == "Tell the time with the tool." and stored.output[0].type == call.type
    )
    [asked] = client.responses.input_items.list(stored.id).data
    assert asked.content[0].text == "What time is it in Berlin?"  # type: ignore[union-attr]
