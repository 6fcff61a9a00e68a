"""Forced tool calls through the real stack, the random default model and the openai SDK.

The frontend runs ``--tool-call-parser deepseek_v31``, the syntax of the default model's
own template. The model never calls a tool by itself, so every call here is the grammar's
doing: with ``tool_choice: "required"`` and with a named function, every response must
be a valid call (a declared name, arguments that validate against its schema) with
``finish_reason: "tool_calls"``, and the streamed deltas (id, type and name first, then
argument fragments) must add up to the unary response for the same seed
(tests/integration/forced_calls.py).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.integration.forced_calls import ask, check_forced_calls
from tests.live_stack import front_half

CHOICES: list[tuple[str, Any]] = [
    ("required", "required"),
    ("named", {"type": "function", "function": {"name": "get_time"}}),
]

stack = front_half("tool-call-logs", frontend_args=["--tool-call-parser", "deepseek_v31"])


@pytest.mark.parametrize(("label", "choice"), CHOICES, ids=[c[0] for c in CHOICES])
def test_forced_calls_are_valid_and_streams_match(
    client: openai.OpenAI, model_id: str, label: str, choice: Any
) -> None:
    check_forced_calls(client, model_id, choice)


def test_auto_and_none_leave_the_random_models_text_as_content(
    client: openai.OpenAI, model_id: str
) -> None:
    # Without a forcing grammar a call could only start where the model wrote the section's
    # opening token: 64 tokens of each show the parser leaves plain text alone.
    for choice in ("auto", "none"):
        unary = ask(client, model_id, 0, choice, max_tokens=64)
        assert unary.choices[0].message.tool_calls is None
        assert unary.choices[0].finish_reason in ("stop", "length")


def test_a_forced_choice_beside_another_grammar_is_refused(
    client: openai.OpenAI, model_id: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, model_id, 0, "required", response_format={"type": "json_object"})
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
