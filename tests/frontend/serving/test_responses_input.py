"""Responses requests → chat requests, and chat answers → Responses output and events."""

from __future__ import annotations

from google.protobuf import json_format, struct_pb2
from tokenline.v1 import openai_pb2, responses_pb2

from services.frontend.serving.responses_events import ResponseEvents
from services.frontend.serving.responses_input import (
    chat_request_of,
    input_messages,
    output_message,
    responses_field,
)
from services.frontend.serving.responses_output import new_response, response_of


def _value(data: object) -> struct_pb2.Value:
    return json_format.ParseDict(data, struct_pb2.Value())


def test_string_input_and_instructions_become_system_then_user() -> None:
    req = responses_pb2.ResponsesRequest(input_text="hi", instructions="be brief")
    chat = chat_request_of(req, stream=False)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "be brief"), ("user", "hi")]
    assert not chat.stream and not chat.stream_options.include_usage


def test_items_map_to_messages_and_calls_share_one_assistant_message() -> None:
    items = [
        responses_pb2.ResponsesInputItem(
            role="user",
            parts=openai_pb2.ContentParts(
                parts=[openai_pb2.ContentPart(type="input_text", text="x")]
            ),
        ),
        responses_pb2.ResponsesInputItem(
            type="function_call", call_id="c1", name="f", arguments='{"a":1}'
        ),
        responses_pb2.ResponsesInputItem(type="function_call", call_id="c2", name="g"),
        responses_pb2.ResponsesInputItem(type="function_call_output", call_id="c1", output="42"),
    ]
    req = responses_pb2.ResponsesRequest(input_items=responses_pb2.ResponsesInputItems(items=items))
    messages = chat_request_of(req, stream=True).messages
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[0].parts.parts[0].type == "text"
    assert [(c.id, c.index) for c in messages[1].tool_calls] == [("c1", 0), ("c2", 1)]
    assert messages[2].tool_call_id == "c1" and messages[2].content == "42"


def test_sampling_budget_format_and_named_tool_choice() -> None:
    req = responses_pb2.ResponsesRequest(
        input_text="x",
        max_output_tokens=7,
        temperature=0.0,
        seed=3,
        tools=[responses_pb2.ResponsesTool(type="function", name="f", parameters_json="{}")],
        tool_choice=_value({"type": "function", "name": "f"}),
        text_format=responses_pb2.ResponsesTextFormat(
            type="json_schema", name="s", schema_json='{"type":"object"}'
        ),
    )
    chat = chat_request_of(req, stream=True)
    assert chat.max_completion_tokens == 7 and chat.sampling.HasField("temperature")
    assert chat.sampling.seed == 3 and not chat.sampling.HasField("top_p")
    assert chat.tools[0].function.name == "f"
    assert json_format.MessageToDict(chat.tool_choice) == {
        "type": "function",
        "function": {"name": "f"},
    }
    assert chat.sampling.response_format.json_schema.schema_json == '{"type":"object"}'
    assert chat.stream_options.include_usage


def test_chat_field_names_become_responses_field_names() -> None:
    assert responses_field("max_completion_tokens") == "max_output_tokens"
    assert responses_field("response_format.type") == "text.format.type"
    assert responses_field("messages[2].content") == "input[2].content"
    assert responses_field("temperature") == "temperature"
    assert responses_field("max_tokens_x") == "max_tokens_x"


def _completion(content: str, finish: str) -> openai_pb2.ChatCompletion:
    out = openai_pb2.ChatCompletion(id="chatcmpl-abc", created=5, model="m")
    choice = out.choices.add(finish_reason=finish)
    choice.message.content = content
    out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens = 3, 4, 7
    out.usage.prompt_tokens_details.cached_tokens = 2
    return out


def test_a_budget_cut_is_incomplete_with_usage() -> None:
    req = responses_pb2.ResponsesRequest(input_text="x", max_output_tokens=4)
    resp = response_of(req, "abc", _completion("hey", "length"))
    assert (resp.id, resp.status, resp.incomplete_reason) == (
        "resp_abc",
        "incomplete",
        "max_output_tokens",
    )
    assert resp.output[0].content[0].text == "hey" and resp.output[0].status == "incomplete"
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.cached_tokens) == (
        3,
        4,
        2,
    )


def _chunk(**delta: object) -> openai_pb2.ChatCompletionChunk:
    chunk = openai_pb2.ChatCompletionChunk()
    chunk.choices.add().delta.MergeFrom(openai_pb2.ChatDelta(**delta))  # type: ignore[arg-type]
    return chunk


def test_events_run_in_order_and_deltas_make_the_text() -> None:
    req = responses_pb2.ResponsesRequest(input_text="x")
    events = ResponseEvents(new_response(req, "abc", 1, "m"))
    out = events.start() + events.feed(_chunk(content="he")) + events.feed(_chunk(content="y"))
    call = openai_pb2.ToolCall(index=0, id="call_1", function=openai_pb2.ToolCallFunction(name="f"))
    out += events.feed(_chunk(tool_calls=[call]))
    call.function.name, call.function.arguments = "", '{"a": 1}'
    out += events.feed(_chunk(tool_calls=[call]))
    final = openai_pb2.ChatCompletionChunk(usage=openai_pb2.CompletionUsage(prompt_tokens=2))
    out += events.feed(final) + events.end()
    assert [e.sequence_number for e in out] == list(range(len(out)))
    assert [e.type.removeprefix("response.") for e in out] == [
        "created", "in_progress", "output_item.added", "content_part.added",
        "output_text.delta", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done", "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done", "completed",
    ]  # fmt: skip
    done = out[-1].response
    assert done.output[0].content[0].text == "hey"
    assert (done.output[1].name, done.output[1].arguments) == ("f", '{"a": 1}')
    assert done.usage.input_tokens == 2 and done.status == "completed"


def test_a_continuation_puts_history_after_instructions_and_output_reads_back() -> None:
    previous = responses_pb2.Response()
    previous.output.add(type="message").content.add(text="hello")
    previous.output.add(type="function_call", call_id="c", name="f", arguments="{}")
    turn = output_message(previous)
    assert (turn.role, turn.content) == ("assistant", "hello")
    assert [(c.id, c.function.name) for c in turn.tool_calls] == [("c", "f")]
    req = responses_pb2.ResponsesRequest(input_text="next", instructions="sys")
    history = [openai_pb2.ChatMessage(role="user", content="first"), turn]
    chat = chat_request_of(req, stream=False, history=history)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert [m.content for m in input_messages(req)] == ["next"]


def test_reasoning_then_text_are_two_items_and_a_budget_cut_is_incomplete() -> None:
    events = ResponseEvents(new_response(responses_pb2.ResponsesRequest(), "abc", 1, "m"))
    out = events.feed(_chunk(reasoning_content="hmm")) + events.feed(_chunk(content="ok"))
    finish = openai_pb2.ChatCompletionChunk()
    finish.choices.add(finish_reason="length")
    out += events.feed(finish) + events.end()
    types = [e.type.removeprefix("response.") for e in out]
    assert types[:3] == ["output_item.added", "reasoning_text.delta", "reasoning_text.done"]
    assert types[-1] == "incomplete" and out[-1].response.incomplete_reason == "max_output_tokens"
    reasoning, message = out[-1].response.output
    assert (reasoning.type, reasoning.reasoning_text) == ("reasoning", "hmm")
    assert (message.status, message.content[0].text) == ("incomplete", "ok")
