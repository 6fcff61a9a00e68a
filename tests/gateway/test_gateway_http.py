"""Raw HTTP against the gateway: error mapping, auth, limits, native and ops routes."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import grpc
import httpx
import pytest
from fake_frontend import MODEL_ID, PIECES, TIMES, FakeFrontend, FakeFrontendServicer
from gateway_harness import GatewayServer, StrictGateway
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig
from gateway.routes import openai as routes_openai
from tests.waiting import wait_until

CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}


def _assert_error_shape(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in resp.text
    return body["error"]


@pytest.mark.parametrize(
    ("code", "status", "error_type"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
        (grpc.StatusCode.ALREADY_EXISTS, 409, "conflict_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
        (grpc.StatusCode.ABORTED, 500, "server_error"),
    ],
)
def test_grpc_status_maps_to_http(
    gateway_url: str,
    fake: FakeFrontendServicer,
    code: grpc.StatusCode,
    status: int,
    error_type: str,
) -> None:
    fake.script.fail_code = code
    fake.script.fail_message = "boom happened"
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json=CHAT, timeout=10)
    error = _assert_error_shape(resp, status)
    assert error == {
        "message": "boom happened",
        "type": error_type,
        "param": None,
        "code": code.name.lower(),
    }
    # Overload and unavailability tell the client when to retry; other errors do not.
    assert resp.headers.get("retry-after") == ("1" if status in (429, 503) else None)


def test_the_field_in_the_rich_status_becomes_param(
    gateway_url: str, fake: FakeFrontendServicer
) -> None:
    fake.script.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    fake.script.fail_message = "messages[0].content: image parts are not supported"
    fake.script.fail_field = "messages[0].content"
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json=CHAT, timeout=10)
    error = _assert_error_shape(resp, 400)
    assert error["param"] == "messages[0].content"
    assert error["message"] == "messages[0].content: image parts are not supported"


def test_malformed_json_is_400(gateway_url: str, fake: FakeFrontendServicer) -> None:
    resp = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        content=b'{"model": "m", "messages": [',
        headers={"content-type": "application/json"},
        timeout=10,
    )
    error = _assert_error_shape(resp, 400)
    assert error["code"] == "invalid_json"
    assert fake.observed.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (CHAT | {"temperature": "hot"}, "temperature"),
        (CHAT | {"stop": 3}, "stop"),
        (CHAT | {"logit_bias": {"not-an-id": 1.0}}, "logit_bias"),
        (CHAT | {"seed": 2**70}, "seed"),
    ],
)
def test_bad_field_types_are_400_with_param(
    gateway_url: str, fake: FakeFrontendServicer, body: dict[str, object], param: str
) -> None:
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=10)
    assert _assert_error_shape(resp, 400)["param"] == param
    assert fake.observed.requests == []


def test_metadata_is_accepted_and_unknown_fields_are_refused(
    gateway_url: str, fake: FakeFrontendServicer
) -> None:
    body = CHAT | {"metadata": {"k": "v"}, "store": False}
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 200
    assert fake.observed.last("ChatCompletion").messages[0].content == "hi"
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json=body | {"surprise": 1}, timeout=10)
    assert _assert_error_shape(resp, 400)["param"] == "surprise"


def test_empty_prompt_list_is_400(gateway_url: str) -> None:
    resp = httpx.post(f"{gateway_url}/v1/completions", json={"prompt": []}, timeout=10)
    assert _assert_error_shape(resp, 400)["param"] == "prompt"


def test_unknown_route_is_openai_shaped_404(gateway_url: str) -> None:
    _assert_error_shape(httpx.get(f"{gateway_url}/v1/nope", timeout=10), 404)


def test_request_id_echoed_and_forwarded(gateway_url: str, fake: FakeFrontendServicer) -> None:
    headers = {"X-Request-Id": "abc-123"}
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json=CHAT, headers=headers)
    assert resp.headers["x-request-id"] == "abc-123"
    assert fake.observed.last("ChatCompletion").request_id == "abc-123"
    assert fake.observed.metadata[-1]["x-request-id"] == "abc-123"
    generated = httpx.post(f"{gateway_url}/v1/chat/completions", json=CHAT)
    assert len(generated.headers["x-request-id"]) == 32
    assert fake.observed.last("ChatCompletion").request_id == generated.headers["x-request-id"]
    error = httpx.get(f"{gateway_url}/v1/nope", headers=headers)
    assert error.headers["x-request-id"] == "abc-123"
    unusable = httpx.post(
        f"{gateway_url}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "a b" * 100}
    )
    assert unusable.headers["x-request-id"] == fake.observed.last("ChatCompletion").request_id
    assert " " not in unusable.headers["x-request-id"]


class TestAuth:
    def test_open_gateway_needs_no_key(self, gateway_url: str) -> None:
        assert httpx.get(f"{gateway_url}/v1/models").status_code == 200

    @pytest.mark.parametrize("auth", [None, "Bearer wrong", "test-key", "Basic test-key"])
    def test_missing_or_wrong_key_is_401(
        self, strict_gateway: StrictGateway, fake: FakeFrontendServicer, auth: str | None
    ) -> None:
        headers = {"Authorization": auth} if auth else {}
        for method, path in (("GET", "/v1/models"), ("POST", "/generate")):
            resp = httpx.request(method, f"{strict_gateway.url}{path}", headers=headers, json={})
            assert _assert_error_shape(resp, 401)["code"] == "invalid_api_key"
            assert resp.headers["www-authenticate"] == "Bearer"
        assert fake.observed.requests == []

    def test_right_key_is_accepted(self, strict_gateway: StrictGateway) -> None:
        resp = httpx.get(f"{strict_gateway.url}/v1/models", headers=strict_gateway.auth)
        assert resp.status_code == 200 and resp.json()["data"][0]["id"] == MODEL_ID

    def test_health_and_metrics_are_open(self, strict_gateway: StrictGateway) -> None:
        assert httpx.get(f"{strict_gateway.url}/health").status_code == 200
        assert httpx.get(f"{strict_gateway.url}/metrics").status_code == 200


def test_body_too_large_is_413(strict_gateway: StrictGateway, fake: FakeFrontendServicer) -> None:
    url, headers = f"{strict_gateway.url}/v1/chat/completions", strict_gateway.auth
    content = "x" * strict_gateway.max_body_bytes
    big = CHAT | {"messages": [{"role": "user", "content": content}]}
    assert _assert_error_shape(httpx.post(url, json=big, headers=headers), 413)["code"] == (
        "request_too_large"
    )

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit must count streamed bytes
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        yield content.encode()
        yield b'"}]}'

    json_headers = headers | {"content-type": "application/json"}
    _assert_error_shape(httpx.post(url, content=chunked(), headers=json_headers), 413)
    assert fake.observed.requests == []
    assert httpx.post(url, json=CHAT, headers=headers).status_code == 200


def test_deadline_is_504(strict_gateway: StrictGateway, fake: FakeFrontendServicer) -> None:
    fake.script.delay_s = 5  # past the deadline: an answer at all would be a 200
    url = f"{strict_gateway.url}/v1/chat/completions"
    resp = httpx.post(url, json=CHAT, headers=strict_gateway.auth)
    assert _assert_error_shape(resp, 504)["code"] == "deadline_exceeded"


def test_generate_native(gateway_url: str, fake: FakeFrontendServicer) -> None:
    body = {
        "text": "p",
        "sampling_params": {"max_new_tokens": 4, "stop": "x", "temperature": 0.0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "metadata": {"k": 1},
    }
    resp = httpx.post(f"{gateway_url}/generate", json=body, headers={"X-Request-Id": "r1"})
    assert resp.status_code == 200
    req = fake.observed.last("Generate")
    assert req.rid == "r1" and list(req.text) == ["p"]
    assert req.sampling_params.max_new_tokens == 4 and list(req.sampling_params.stop) == ["x"]
    assert req.sampling_params.HasField("temperature")
    assert req.logprob.return_logprob and req.logprob.top_logprobs_num == 2
    output = resp.json()  # SGLang's shape: one object for one prompt
    assert output["text"] == "".join(PIECES) and output["output_ids"] == [7, 8]
    assert output["meta_info"]["finish_reason"] == {"type": "length", "matched": None, "length": 2}
    assert output["meta_info"]["completion_tokens"] == 2


def test_generate_token_ids_forms(gateway_url: str, fake: FakeFrontendServicer) -> None:
    for ids, expected in (([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])):
        assert httpx.post(f"{gateway_url}/generate", json={"input_ids": ids}).status_code == 200
        assert [list(t.ids) for t in fake.observed.last("Generate").input_ids] == expected
    proto_json = {"inputIds": [{"ids": [4]}], "rid": "mine"}
    assert httpx.post(f"{gateway_url}/generate", json=proto_json).status_code == 200
    req = fake.observed.last("Generate")
    assert [list(t.ids) for t in req.input_ids] == [[4]] and req.rid == "mine"


def test_tokenize_and_detokenize(gateway_url: str, fake: FakeFrontendServicer) -> None:
    resp = httpx.post(f"{gateway_url}/v1/tokenize", json={"prompt": "ab"})
    assert resp.json() == {"tokens": [97, 98], "count": 2, "max_model_len": 4096}
    assert fake.observed.last("Tokenize").add_special_tokens is True
    resp = httpx.post(f"{gateway_url}/v1/detokenize", json={"tokens": [104, 105]})
    assert resp.json() == {"prompt": "hi"}
    _assert_error_shape(httpx.post(f"{gateway_url}/v1/detokenize", json={"tokens": [2**40]}), 400)


def test_health_follows_frontend_readiness(gateway_url: str, fake_frontend: FakeFrontend) -> None:
    assert httpx.get(f"{gateway_url}/health").status_code == 200
    fake_frontend.set_serving(False)
    _assert_error_shape(httpx.get(f"{gateway_url}/health"), 503)


def _models_served(gateway_url: str) -> tuple[float, float]:
    """The gateway's (request count, latency observations) for GET /v1/models so far."""
    text = httpx.get(f"{gateway_url}/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    ok = (("method", "GET"), ("route", "/v1/models"), ("status", "200"))
    route = (("route", "/v1/models"),)
    return (
        samples.get(("tokenline_gateway_requests_total", ok), 0.0),
        samples.get(("tokenline_gateway_request_duration_seconds_count", route), 0.0),
    )


def test_metrics_count_requests(gateway_url: str) -> None:
    # The gateway lives for the whole session: other tests' requests are counted too,
    # so only the change across this one request says it was counted.
    before = _models_served(gateway_url)
    assert httpx.get(f"{gateway_url}/v1/models").status_code == 200
    # The middleware counts a request after its last byte went out: it may trail the reply.
    wait_until(lambda: _models_served(gateway_url) != before, what="the request counted")
    count, latencies = _models_served(gateway_url)
    assert (count, latencies) == (before[0] + 1, before[1] + 1)


def test_openapi_documents_request_bodies(gateway_url: str) -> None:
    spec = httpx.get(f"{gateway_url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/generate"} <= set(spec["paths"])
    chat = spec["components"]["schemas"]["ChatCompletionBody"]
    assert "messages" in chat["required"] and chat["additionalProperties"] is True
    assert "max_completion_tokens" in chat["properties"]


def test_body_must_be_a_json_object(gateway_url: str) -> None:
    for content in (b"[1, 2]", b"prompt=x"):
        resp = httpx.post(f"{gateway_url}/v1/completions", content=content)
        assert "JSON object" in _assert_error_shape(resp, 400)["message"]


def test_unreachable_frontend_is_503_without_internal_address() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    server = GatewayServer(GatewayConfig(frontend_addr=dead, request_timeout_s=5)).start()
    try:
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
        error = _assert_error_shape(resp, 503)
        assert dead not in error["message"] and error["code"] == "unavailable"
        assert httpx.get(f"{server.url}/health").status_code == 503
    finally:
        server.stop()


def test_unexpected_gateway_bug_is_a_clean_500(
    gateway_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object, **__: object) -> dict[str, object]:
        raise RuntimeError("secret internals")

    # The gateway under test runs in this process, so its renderer can be broken on purpose.
    monkeypatch.setattr(routes_openai, "chat_completion_to_dict", broken)
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json=CHAT)
    error = _assert_error_shape(resp, 500)
    assert "secret" not in resp.text and error["code"] == "internal_error"
    assert resp.headers["x-request-id"]


def test_render_failure_mid_stream_is_an_error_frame(
    gateway_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object, **__: object) -> dict[str, object]:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(routes_openai, "chat_chunk", broken)
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json=CHAT | {"stream": True})
    assert resp.status_code == 200 and "secret" not in resp.text
    assert resp.text.startswith('data: {"error":') and "[DONE]" not in resp.text


def test_debug_header_adds_the_stage_breakdown(gateway_url: str) -> None:
    plain = httpx.post(f"{gateway_url}/v1/chat/completions", json=CHAT, timeout=10).json()
    assert "debug" not in plain
    resp = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json=CHAT,
        headers={"X-Tokenline-Debug": "1"},
        timeout=10,
    )
    debug = resp.json()["debug"]
    assert debug["times"]["detokenized"] == TIMES.detokenized
    assert debug["stages_ms"]["prefill"] == pytest.approx(10.0)
    assert debug["stages_ms"]["end_to_end"] == pytest.approx(21.0)


def test_debug_header_puts_the_breakdown_on_each_finish_chunk(gateway_url: str) -> None:
    def frames(headers: dict[str, str]) -> list[dict]:
        body = {**CHAT, "stream": True, "n": 2}
        with httpx.stream(
            "POST", f"{gateway_url}/v1/chat/completions", json=body, headers=headers, timeout=10
        ) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
        return [json.loads(line.removeprefix("data: ")) for line in lines]

    assert not [f for f in frames({}) if "debug" in f]
    got = frames({"X-Tokenline-Debug": "1"})
    with_debug = [f for f in got if "debug" in f]
    assert [f["choices"][0]["index"] for f in with_debug] == [0, 1]
    assert all(f["choices"][0]["finish_reason"] == "stop" for f in with_debug)
    assert with_debug[0]["debug"]["stages_ms"]["detokenize"] == pytest.approx(1.0)
