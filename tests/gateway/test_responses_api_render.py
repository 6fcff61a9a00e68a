"""``/v1/responses`` at the gateway layer, no frontend: JSON → ResponsesRequest, and the
protos → OpenAI's response object and SSE event frames."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from tokenline.v1 import responses_pb2

from gateway.errors import GatewayError
from gateway.responses_api.convert import responses_request_to_proto
from gateway.responses_api.render import (
    ResponseFrames,
    event_to_dict,
    item_list_to_dict,
    response_to_dict,
)
from gateway.responses_api.schemas import ResponsesBody


@pytest.fixture(autouse=True)
def fake() -> None:
    """No frontend here: override the gateway suite's autouse fake-frontend reset."""


def test_items_parts_tools_and_format_reach_the_proto() -> None:
    body = ResponsesBody.model_validate(
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"b": 1, "a": 2}}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"z": 1, "a": 2}}},
            "max_output_tokens": 9,
            "reasoning": {"effort": "low"},
        }
    )
    out = responses_request_to_proto(body, "rid")
    items = out.input_items.items
    assert items[0].type == "message" and items[0].parts.parts[0].type == "input_text"
    assert (items[1].call_id, items[1].name) == ("c", "f")
    assert out.tools[0].parameters_json == '{"b": 1, "a": 2}'  # the client's key order
    assert out.text_format.schema_json == '{"z": 1, "a": 2}'
    assert json_format.MessageToDict(out.tool_choice) == {"type": "function", "name": "f"}
    assert out.max_output_tokens == 9 and out.reasoning_effort == "low"
    assert out.request_id == "rid" and not out.HasField("temperature")


def test_an_int32_overflow_is_a_400_naming_the_field() -> None:
    body = ResponsesBody.model_validate({"input": "x", "max_output_tokens": 2**40})
    with pytest.raises(GatewayError) as info:
        responses_request_to_proto(body, "rid")
    assert info.value.status == 400 and info.value.param == "max_output_tokens"


def _response() -> responses_pb2.Response:
    resp = responses_pb2.Response(id="resp_x", model="m", status="incomplete")
    resp.incomplete_reason = "max_output_tokens"
    item = resp.output.add(type="message", id="msg_x", status="incomplete", role="assistant")
    item.content.add(type="output_text", text="hey")
    resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.cached_tokens = 3, 2, 1
    return resp


def test_the_response_object_has_openais_shape() -> None:
    out = response_to_dict(_response())
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["content"][0] == {
        "type": "output_text",
        "text": "hey",
        "annotations": [],
        "logprobs": [],
    }
    assert out["usage"]["input_tokens_details"] == {"cached_tokens": 1}
    assert out["max_output_tokens"] is None and out["temperature"] is None


def test_events_carry_only_their_types_fields() -> None:
    delta = responses_pb2.ResponseStreamEvent(
        type="response.output_text.delta", sequence_number=4, item_id="msg_x", delta="he"
    )
    assert event_to_dict(delta) == {
        "type": "response.output_text.delta",
        "sequence_number": 4,
        "output_index": 0,
        "item_id": "msg_x",
        "content_index": 0,
        "delta": "he",
        "logprobs": [],
    }
    args = responses_pb2.ResponseStreamEvent(
        type="response.function_call_arguments.done", item_id="fc", arguments="{}"
    )
    assert "content_index" not in event_to_dict(args) and event_to_dict(args)["arguments"] == "{}"


def test_frames_name_the_event_and_a_failure_continues_the_sequence() -> None:
    frames = ResponseFrames()
    event = responses_pb2.ResponseStreamEvent(
        type="response.completed", sequence_number=7, response=_response()
    )
    head, data = frames.event(event).decode().split("\n", 1)
    assert head == "event: response.completed"
    assert json.loads(data.removeprefix("data: "))["response"]["status"] == "incomplete"
    assert frames.end() == b"" and frames.keepalive() == b": keep-alive\n\n"
    failed = frames.fail(GatewayError(500, "boom")).decode()
    assert failed.startswith("event: error\n")
    body = json.loads(failed.split("data: ", 1)[1])
    assert body["sequence_number"] == 8 and body["error"]["message"] == "boom"


def test_input_items_as_the_sdk_reads_them_and_a_failed_background_response() -> None:
    from openai.pagination import SyncCursorPage
    from openai.types.responses import ResponseItem

    item = responses_pb2.ResponseOutputItem
    page = responses_pb2.ResponseItemList(
        object="list",
        data=[
            item(type="function_call_output", id="fco_1", status="completed", call_id="c",
                 output="4"),
            item(type="message", id="msg_1", status="completed", role="user",
                 content=[responses_pb2.ResponseOutputText(type="input_text", text="hi")]),
        ],
        first_id="fco_1", last_id="msg_1", has_more=True,
    )  # fmt: skip
    listed = item_list_to_dict(page)
    assert listed["data"][1]["content"] == [{"type": "input_text", "text": "hi"}]
    parsed = SyncCursorPage[ResponseItem].model_validate(listed)  # type: ignore[misc]
    assert [i.type for i in parsed.data] == ["function_call_output", "message"]
    assert parsed.data[0].output == "4" and parsed.has_more  # type: ignore[union-attr]
    failed = _response()
    failed.status, failed.background = "failed", True
    failed.error.code, failed.error.message = "unavailable", "scheduler lost"
    shown = response_to_dict(failed)
    assert shown["error"] == {"code": "unavailable", "message": "scheduler lost"}
    assert shown["background"] is True and shown["status"] == "failed"
    assert response_to_dict(_response())["error"] is None
