"""``/v1/messages`` through the official ``anthropic`` SDK against the shared live stack
(gateway → frontend → scheduler → detokenizer), at the defaults ``make run`` starts.

The model is random: nothing here reads what the text says. Greedy requests
(``temperature: 0``) decode the same tokens alone or in company (the shared scheduler is
batch-invariant), so the requests a test needs go out at once and are compared with each
other; tool use is forced by the grammar that ``tool_choice`` any / a named tool selects.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from services.launch import LocalStack
from tests.integration.forced_calls import BUDGET, SCHEMAS, TOOLS

ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
# anthropic 2.x's create() has no sampling arguments any more; the API still takes them.
GREEDY = {"temperature": 0.0}
HELLO = [{"role": "user", "content": "Say hello."}]
# Letters the random model's text will likely hold; whether it does is read, not assumed.
STOPS = ["e", "a", "o", "t"]


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> anthropic.Anthropic:
    root = stack.base_url.removesuffix("/v1")
    return anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(stack: LocalStack) -> str:
    reply = httpx.get(f"{stack.base_url}/models", timeout=30).json()
    return str(reply["data"][0]["id"])


def at_once(*calls: Callable[[], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def streamed(client: anthropic.Anthropic, **kwargs: Any) -> tuple[list[Any], Any]:
    """(the raw events, the SDK's accumulated final message) of one messages.stream."""
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def check_event_order(events: list[Any]) -> None:
    """Anthropic's grammar of a stream: start, blocks each opened → deltas → closed in
    index order, then message_delta and message_stop."""
    kinds = [e.type for e in events if e.type in RAW_EVENTS]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for e in events:
        if e.type == "content_block_start":
            assert open_index is None and e.index == next_index
            open_index = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_index
        elif e.type == "content_block_stop":
            assert e.index == open_index
            open_index, next_index = None, next_index + 1
    assert open_index is None


RAW_EVENTS = {
    "message_start", "content_block_start", "content_block_delta", "content_block_stop",
    "message_delta", "message_stop",
}  # fmt: skip


def test_unary_and_stream_agree_and_system_counts(
    client: anthropic.Anthropic, model_id: str
) -> None:
    """The same greedy request unary and streamed: the same text, stop_reason and usage;
    a system prompt (a string or text blocks) is templated in, so the prompt grows."""
    ask = {"model": model_id, "max_tokens": 8, "extra_body": GREEDY, "messages": HELLO}
    system = [{"type": "text", "text": "You are terse."}]
    unary, (events, final), with_system, with_blocks = at_once(
        lambda: client.messages.create(**ask),
        lambda: streamed(client, **ask),
        lambda: client.messages.create(**ask, system="You are terse."),
        lambda: client.messages.create(**ask, system=system),
    )
    assert unary.type == "message" and unary.role == "assistant" and unary.model == model_id
    assert unary.id.startswith("msg_")
    assert unary.stop_reason in ("end_turn", "max_tokens") and unary.stop_sequence is None
    assert 0 < unary.usage.output_tokens <= 8
    check_event_order(events)
    assert text_of(final) == text_of(unary)
    assert final.stop_reason == unary.stop_reason
    assert final.usage.input_tokens == unary.usage.input_tokens
    assert final.usage.output_tokens == unary.usage.output_tokens
    assert events[0].message.usage.input_tokens == unary.usage.input_tokens
    assert with_system.usage.input_tokens > unary.usage.input_tokens
    assert with_blocks.usage.input_tokens == with_system.usage.input_tokens


def test_stop_sequences(client: anthropic.Anthropic, model_id: str) -> None:
    """A greedy request with and without stop_sequences: the stopped one ends where the
    other's text first holds a stop (reported as stop_sequence, left out of the text), or,
    when the other's holds none, is the same text; the stream reports the same stop."""
    ask = {"model": model_id, "max_tokens": 24, "extra_body": GREEDY, "messages": HELLO}
    free, stopped, (events, final) = at_once(
        lambda: client.messages.create(**ask),
        lambda: client.messages.create(**ask, stop_sequences=STOPS),
        lambda: streamed(client, **ask, stop_sequences=STOPS),
    )
    full, cut = text_of(free), text_of(stopped)
    assert not any(s in cut for s in STOPS)
    assert full.startswith(cut)
    if stopped.stop_reason == "stop_sequence":
        assert stopped.stop_sequence in STOPS and stopped.stop_sequence in full[len(cut) :]
    else:
        assert not any(s in full for s in STOPS) and cut == full
        assert stopped.stop_sequence is None
    check_event_order(events)
    assert (final.stop_reason, final.stop_sequence) == (stopped.stop_reason, stopped.stop_sequence)
    assert text_of(final) == cut


def _check_tool_use(message: Any, allowed: set[str]) -> list[tuple[str, Any]]:
    assert message.stop_reason == "tool_use", message
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1
    for call in calls:
        assert call.name in allowed and call.id
        jsonschema.validate(call.input, SCHEMAS[call.name])
    return [(c.name, c.input) for c in calls]


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "tool", "name": "get_weather"},
    ],
)
def test_forced_tool_use(client: anthropic.Anthropic, model_id: str, choice: Any) -> None:
    """tool_choice any / a named tool: one tool_use block whose input follows the tool's
    input_schema, stop_reason tool_use; streamed, the same call in input_json_delta pieces."""
    ask = {
        "model": model_id,
        "max_tokens": BUDGET,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "Weather or time?"}],
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": choice,
    }
    allowed = {choice["name"]} if choice["type"] == "tool" else set(SCHEMAS)
    unary, (events, final) = at_once(
        lambda: client.messages.create(**ask), lambda: streamed(client, **ask)
    )
    calls = _check_tool_use(unary, allowed)
    check_event_order(events)
    assert any(getattr(e, "delta", None) and e.delta.type == "input_json_delta" for e in events)
    assert _check_tool_use(final, allowed) == calls


def test_a_tool_round_trip_is_templated(client: anthropic.Anthropic, model_id: str) -> None:
    """An assistant tool_use turn and the user's tool_result (an error, in blocks) are
    accepted, and make the prompt longer than the question alone."""
    turns = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Oslo", "unit": "celsius"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "Try again?"},
            ],
        },
    ]  # fmt: skip
    ask = {"model": model_id, "max_tokens": 2, "extra_body": GREEDY, "tools": ANTHROPIC_TOOLS}
    alone, round_trip = at_once(
        lambda: client.messages.create(**ask, messages=turns[:1]),
        lambda: client.messages.create(**ask, messages=turns),
    )
    assert round_trip.usage.input_tokens > alone.usage.input_tokens


GOOD = {"model": "m", "max_tokens": 4, "messages": HELLO}
BAD_BODIES: list[tuple[dict[str, Any], str, str]] = [
    ({"model": "m", "messages": HELLO}, "max_tokens", ""),
    ({**GOOD, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role", ""),
    ({**GOOD, "messages": []}, "messages", ""),
    (
        {**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages.0.content.0.type",
        "'image'",
    ),
    (
        {**GOOD, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t",
                                                           "name": "f", "input": {}}]}]},
        "messages.0.content.0.type",
        "'tool_use'",
    ),
    (
        {**GOOD, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        "messages.0.content.0.tool_use_id",
        "",
    ),
    ({**GOOD, "system": [{"type": "document"}]}, "system.0.type", "'document'"),
    ({**GOOD, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type", ""),
    ({**GOOD, "tools": [{"name": "web", "type": "web_search_20250305", "input_schema": {}}]},
     "tools.0.type", ""),
    ({**GOOD, "tool_choice": {"type": "tool"}}, "tool_choice.name", ""),
    ({**GOOD, "stop_sequences": "x"}, "stop_sequences", ""),
    ({**GOOD, "output_format": {"type": "json_schema"}}, "output_format", ""),
    # Refused by the frontend, named as a Messages client spells it.
    ({**GOOD, "temperature": -1.0}, "temperature", ""),
    ({**GOOD, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "auto"}}, "tool_choice",
     "--tool-call-parser"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "field", "named"), BAD_BODIES)
def test_bad_input_is_an_anthropic_400_naming_the_field(
    stack: LocalStack, model_id: str, body: dict[str, Any], field: str, named: str
) -> None:
    """Unary and streamed alike: a 400 JSON body (no event was sent) in Anthropic's shape,
    its message starting with the field."""
    url = f"{stack.base_url}/messages"
    for stream in (False, True):
        resp = httpx.post(url, json={**body, "model": model_id, "stream": stream}, timeout=30)
        assert resp.status_code == 400, resp.text
        assert resp.headers["content-type"] == "application/json"
        reply = resp.json()
        assert reply["type"] == "error" and set(reply) == {"type", "error"}
        assert reply["error"]["type"] == "invalid_request_error"
        assert reply["error"]["message"].startswith(f"{field}: "), reply
        assert named in reply["error"]["message"] and "Traceback" not in resp.text


def test_the_sdk_raises_bad_request_with_the_body(
    client: anthropic.Anthropic, model_id: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=model_id,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],  # type: ignore[list-item]
        )
    assert info.value.status_code == 400
    assert info.value.body["error"]["message"].startswith("messages.0.content.0.type")  # type: ignore[index]


def test_a_ping_follows_message_start_and_the_sdk_skips_it(
    client: anthropic.Anthropic, model_id: str, stack: LocalStack
) -> None:
    """Anthropic's order on the wire (a ping right after message_start), read raw; the
    SDK's stream of the same request has no ping among its events."""
    ask = {"model": model_id, "max_tokens": 4, "messages": HELLO, **GREEDY}

    def raw_event_names() -> list[str]:
        url = f"{stack.base_url}/messages"
        resp = httpx.post(url, json={**ask, "stream": True}, timeout=60)
        assert resp.status_code == 200
        lines = resp.text.split("\n")
        return [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]

    names, (events, final) = at_once(
        raw_event_names,
        lambda: streamed(client, model=model_id, max_tokens=4, messages=HELLO, extra_body=GREEDY),
    )
    assert names[:2] == ["message_start", "ping"]
    assert names[-1] == "message_stop"
    assert "ping" not in [e.type for e in events] and final.usage.output_tokens <= 4
