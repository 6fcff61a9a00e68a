"""Chat answers → Anthropic Messages (gateway/anthropic/render.py), in-process: the whole
message, and a stream's events in Anthropic's order, from hand-made chat protos."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenline.v1 import openai_pb2

from gateway.anthropic.render import MessageEvents, message_to_dict
from gateway.errors import GatewayError

USAGE = openai_pb2.CompletionUsage(prompt_tokens=9, completion_tokens=3, total_tokens=12)


def completion(finish: str, content: str | None = "Hi", **choice: Any) -> openai_pb2.ChatCompletion:
    message = openai_pb2.ChatResponseMessage(role="assistant", content=content)
    return openai_pb2.ChatCompletion(
        id="chatcmpl-abc", model="m", usage=USAGE,
        choices=[openai_pb2.ChatChoice(message=message, finish_reason=finish, **choice)],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("finish", "matched", "stop_reason", "stop_sequence"),
    [
        ("stop", {"matched_str": "END"}, "stop_sequence", "END"),
        ("stop", {}, "end_turn", None),  # the model's own EOS
        ("stop", {"matched_token_id": 7}, "end_turn", None),
        ("length", {}, "max_tokens", None),
    ],
)
def test_the_stop_reason(finish: str, matched: Any, stop_reason: str, stop_sequence: Any) -> None:
    message = message_to_dict(completion(finish, **matched), ["END"])
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, stop_sequence)
    assert message["id"] == "msg_abc" and message["type"] == "message"
    assert message["content"] == [{"type": "text", "text": "Hi"}]
    assert message["usage"] == {"input_tokens": 9, "output_tokens": 3}


def test_tool_calls_become_tool_use_blocks() -> None:
    done = completion("tool_calls", content=None)
    call = done.choices[0].message.tool_calls.add(id="call_1", type="function")
    call.function.name, call.function.arguments = "f", '{"a": 1}'
    message = message_to_dict(done, [])
    assert message["stop_reason"] == "tool_use"
    assert message["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}
    ]


def test_an_aborted_request_is_an_error() -> None:
    with pytest.raises(GatewayError) as info:
        message_to_dict(completion("abort", matched_str="evicted"), [])
    assert info.value.status == 500 and "evicted" in info.value.message


def chunk(**choice: Any) -> openai_pb2.ChatCompletionChunk:
    return openai_pb2.ChatCompletionChunk(
        id="chatcmpl-abc", model="m", choices=[openai_pb2.ChatChunkChoice(**choice)]
    )


def tool_delta(index: int, arguments: str, call_id: str = "", name: str = "") -> Any:
    call = openai_pb2.ToolCall(index=index, id=call_id)
    call.function.name, call.function.arguments = name, arguments
    return openai_pb2.ChatDelta(tool_calls=[call])


def parse(frames: bytes) -> list[dict[str, Any]]:
    """SSE bytes → each event's data, checking ``event:`` names its ``type``."""
    events = []
    for frame in frames.decode().split("\n\n")[:-1]:
        name_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        events.append(data)
    return events


def test_a_stream_of_text_then_a_tool_call() -> None:
    events = MessageEvents([])
    first = chunk(delta=openai_pb2.ChatDelta(role="assistant", content=""))
    first.prompt_token_ids.extend([1, 2, 3])
    frames = [
        events.event(first),
        events.event(chunk(delta=openai_pb2.ChatDelta(content="Hel"))),
        events.event(chunk(delta=openai_pb2.ChatDelta(content="lo"))),
        events.event(chunk(delta=tool_delta(0, '{"a"', call_id="call_1", name="f"))),
        events.event(chunk(delta=tool_delta(0, ": 1}"))),
        events.event(chunk(delta=openai_pb2.ChatDelta(), finish_reason="tool_calls")),
        events.event(openai_pb2.ChatCompletionChunk(id="chatcmpl-abc", model="m", usage=USAGE)),
        events.end(),
    ]
    got = parse(b"".join(frames))
    assert [(e["type"], e.get("index")) for e in got] == [
        ("message_start", None), ("ping", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    start = got[0]["message"]
    assert start["id"] == "msg_abc" and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": 3, "output_tokens": 0}
    assert got[1] == {"type": "ping"} and parse(events.keepalive()) == [{"type": "ping"}]
    assert "".join(e["delta"].get("text", "") for e in got[3:5]) == "Hello"
    assert got[6]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in got[7:9]) == '{"a": 1}'
    assert got[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert got[-2]["usage"] == {"input_tokens": 9, "output_tokens": 3}


def test_a_stream_stopped_by_a_stop_sequence() -> None:
    events = MessageEvents(["\n"])
    frames = events.event(chunk(delta=openai_pb2.ChatDelta(content="x"))) + events.event(
        chunk(delta=openai_pb2.ChatDelta(), finish_reason="stop", matched_str="\n")
    )
    got = parse(frames + events.end())
    assert got[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n"}


def test_a_failure_is_one_error_event() -> None:
    events = MessageEvents([])
    events.event(chunk(delta=openai_pb2.ChatDelta(content="x")))
    (error,) = parse(events.fail(GatewayError(503, "the frontend service is unreachable")))
    assert error == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the frontend service is unreachable"},
    }
    aborted = MessageEvents([])
    aborted.event(chunk(delta=openai_pb2.ChatDelta(), finish_reason="abort", matched_str="evicted"))
    assert [e["type"] for e in parse(aborted.end())] == ["error"]
