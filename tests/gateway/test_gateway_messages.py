"""/v1/messages on the real gateway over a FAKE frontend (tests/gateway/fake_frontend.py):
the anthropic SDK's view of the route, Anthropic's error shape from every layer (a gRPC
status, the API key, the body limit, a failure mid-stream), and the x-api-key header."""

from __future__ import annotations

from typing import Any

import anthropic
import grpc
import httpx
import pytest
from fake_frontend import MODEL_ID, PIECES, USAGE, FakeFrontendServicer
from gateway_harness import StrictGateway

HELLO: list[Any] = [{"role": "user", "content": "hi"}]
BODY = {"model": MODEL_ID, "max_tokens": 4, "messages": HELLO}


def sdk(url: str, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, **kwargs)


def anthropic_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert set(body["error"]) == {"type", "message"} and "Traceback" not in resp.text
    return dict(body["error"])


def test_the_sdk_reads_a_message_and_a_stream(
    stream_gateway_url: str, fake: FakeFrontendServicer
) -> None:
    client = sdk(stream_gateway_url)
    message = client.messages.create(**BODY, stop_sequences=["\n"])
    assert message.content[0].type == "text" and message.content[0].text == "".join(PIECES)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "\n")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 2)
    assert list(fake.observed.last("ChatCompletion").sampling.stop) == ["\n"]
    with client.messages.stream(**BODY) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == "".join(PIECES)
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == USAGE.completion_tokens


def test_a_grpc_refusal_names_the_messages_field(
    gateway_url: str, fake: FakeFrontendServicer
) -> None:
    fake.script.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    fake.script.fail_message, fake.script.fail_field = "too many", "stop"
    for stream in (False, True):
        resp = httpx.post(f"{gateway_url}/v1/messages", json=BODY | {"stream": stream})
        error = anthropic_error(resp, 400)
        assert error == {"type": "invalid_request_error", "message": "stop_sequences: too many"}


def test_a_failure_mid_stream_is_an_error_event(
    gateway_url: str, fake: FakeFrontendServicer
) -> None:
    fake.script.fail_code, fake.script.fail_after = grpc.StatusCode.UNAVAILABLE, 2
    resp = httpx.post(f"{gateway_url}/v1/messages", json=BODY | {"stream": True})
    assert resp.status_code == 200
    assert resp.text.startswith("event: message_start\n")
    last = resp.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ") and '"overloaded_error"' in last
    assert "message_stop" not in resp.text


def test_other_routes_keep_the_openai_shape(gateway_url: str) -> None:
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json={"messages": "x"})
    assert resp.status_code == 400 and set(resp.json()) == {"error"}


class TestApiKey:
    @pytest.mark.parametrize(
        "headers",
        [{"x-api-key": "test-key"}, {"Authorization": "Bearer test-key"}],
    )
    def test_either_header_is_accepted(
        self, strict_gateway: StrictGateway, headers: dict[str, str]
    ) -> None:
        for path in ("/v1/messages", "/v1/chat/completions"):
            resp = httpx.post(f"{strict_gateway.url}{path}", json=BODY, headers=headers)
            assert resp.status_code == 200, resp.text

    def test_the_sdk_sends_x_api_key(self, strict_gateway: StrictGateway) -> None:
        client = anthropic.Anthropic(base_url=strict_gateway.url, api_key="test-key", max_retries=0)
        assert client.messages.create(**BODY).stop_reason == "end_turn"

    @pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}, {"Authorization": "test-key"}])
    def test_a_missing_or_wrong_key_is_401_in_the_routes_shape(
        self, strict_gateway: StrictGateway, fake: FakeFrontendServicer, headers: dict[str, str]
    ) -> None:
        resp = httpx.post(f"{strict_gateway.url}/v1/messages", json=BODY, headers=headers)
        assert anthropic_error(resp, 401)["type"] == "authentication_error"
        openai_side = httpx.get(f"{strict_gateway.url}/v1/models", headers=headers)
        assert openai_side.status_code == 401 and openai_side.json()["error"]["param"] is None
        assert fake.observed.requests == []


def test_a_body_over_the_limit_is_413_in_anthropics_shape(strict_gateway: StrictGateway) -> None:
    big = BODY | {"system": "x" * 2 * strict_gateway.max_body_bytes}
    resp = httpx.post(f"{strict_gateway.url}/v1/messages", json=big, headers=strict_gateway.auth)
    assert anthropic_error(resp, 413)["type"] == "request_too_large"
