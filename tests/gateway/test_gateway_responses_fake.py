"""``/v1/responses`` over the FAKE frontend (tests/gateway/fake_frontend.py): the gateway's
own part: what it forwards, how a gRPC refusal and a mid-stream failure reach the client.
The real path is tests/integration/test_responses_api.py."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from fake_frontend import MODEL_ID, PIECES, FakeFrontendServicer

BODY = {"model": MODEL_ID, "input": "hi", "instructions": "brief", "max_output_tokens": 9}


def test_the_sdk_reads_a_response_and_its_events(
    gateway_url: str, fake: FakeFrontendServicer
) -> None:
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="x", max_retries=0)
    response = client.responses.create(**BODY)  # type: ignore[call-overload]
    assert response.output_text == "".join(PIECES) and response.usage.input_tokens == 5
    sent = fake.observed.last("ResponsesCreate")
    assert (sent.input_text, sent.instructions, sent.max_output_tokens) == ("hi", "brief", 9)
    events = list(client.responses.create(**BODY, stream=True))  # type: ignore[call-overload]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "".join(
        PIECES
    )


def test_a_grpc_refusal_is_a_400_naming_the_field(
    gateway_url: str, fake: FakeFrontendServicer
) -> None:
    fake.script.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    fake.script.fail_message, fake.script.fail_field = "too small", "max_output_tokens"
    for stream in (False, True):
        resp = httpx.post(f"{gateway_url}/v1/responses", json=BODY | {"stream": stream})
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "max_output_tokens"


def test_a_failure_mid_stream_is_one_error_event(
    gateway_url: str, fake: FakeFrontendServicer
) -> None:
    fake.script.fail_code, fake.script.fail_after = grpc.StatusCode.UNAVAILABLE, 2
    resp = httpx.post(f"{gateway_url}/v1/responses", json=BODY | {"stream": True})
    assert resp.status_code == 200 and resp.text.startswith("event: response.created\n")
    last = resp.text.strip().split("\n\n")[-1]
    head, data = last.split("\n", 1)
    assert head == "event: error"
    body = json.loads(data.removeprefix("data: "))
    assert body["sequence_number"] == 2 and body["error"]["message"]
    assert "response.completed" not in resp.text


def test_the_sdks_stored_response_calls_reach_their_rpcs(
    gateway_url: str, fake: FakeFrontendServicer
) -> None:
    """retrieve / input_items.list / delete / cancel: each its own RPC, the id and paging
    passed as sent, and the (empty) replies read back by the SDK's own models."""
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="x", max_retries=0)
    page = client.responses.input_items.list("resp_a", limit=3, order="asc", after="msg_1")
    assert page.data == [] and page.has_more is False
    sent = fake.observed.last("ResponsesInputItems")
    assert (sent.response_id, sent.limit, sent.order, sent.after) == ("resp_a", 3, "asc", "msg_1")
    assert client.responses.delete("resp_b") is None
    assert fake.observed.last("ResponsesDelete").response_id == "resp_b"
    client.responses.cancel("resp_c")
    assert fake.observed.last("ResponsesCancel").response_id == "resp_c"


def test_background_is_forwarded(gateway_url: str, fake: FakeFrontendServicer) -> None:
    resp = httpx.post(f"{gateway_url}/v1/responses", json=BODY | {"background": True})
    assert resp.status_code == 200
    assert fake.observed.last("ResponsesCreate").background is True


def test_input_items_refuse_include_and_an_out_of_range_limit(gateway_url: str) -> None:
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.input_items.list("resp_a", include=["message.input_image.image_url"])
    assert info.value.body["param"] == "include"  # type: ignore[index]
    for query, param in (("limit=abc", "limit"), ("limit=99999999999", "limit"), ("x=1", "x")):
        resp = httpx.get(f"{gateway_url}/v1/responses/resp_a/input_items?{query}")
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
