"""The gateway's streams over one Multiplex call (the default): sharing, deadlines, and a
frontend that goes away and comes back. The SSE tests run on both transports."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from fake_frontend import PIECES, FakeFrontend, FakeFrontendServicer
from gateway_harness import GatewayServer, StrictGateway

from gateway.config import GatewayConfig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _payloads(raw: str) -> list[Any]:
    lines = [line.removeprefix("data: ") for line in raw.split("\n\n") if line]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def _content(payloads: list[Any]) -> str:
    return "".join(
        c["delta"].get("content", "") for p in payloads if p != "[DONE]" for c in p["choices"]
    )


async def test_concurrent_streams_share_one_call_and_each_gets_its_own(
    gateway_url: str, fake: FakeFrontendServicer
) -> None:
    async with httpx.AsyncClient(timeout=10) as http:

        async def one(i: int) -> list[Any]:
            body = CHAT | {"messages": [{"role": "user", "content": f"q{i}"}]}
            resp = await http.post(f"{gateway_url}/v1/chat/completions", json=body)
            assert resp.status_code == 200
            return _payloads(resp.text)

        results = await asyncio.gather(*(one(i) for i in range(24)))
    for payloads in results:
        assert payloads[-1] == "[DONE]" and _content(payloads) == "".join(PIECES)
    streamed = [r for name, r in fake.observed.requests if name == "ChatCompletionStream"]
    assert sorted(r.messages[0].content for r in streamed) == sorted(f"q{i}" for i in range(24))
    assert fake.observed.multiplex_calls <= 1  # one call (opened before, or by the first)


def test_a_stream_past_its_deadline_ends_with_a_timeout_and_is_cancelled_upstream(
    strict_gateway: StrictGateway, fake: FakeFrontendServicer
) -> None:
    fake.script.hang_after = 1
    url = f"{strict_gateway.url}/v1/chat/completions"
    started = time.monotonic()
    resp = httpx.post(url, json=CHAT, headers=strict_gateway.auth, timeout=10)
    assert resp.status_code == 200  # the first frame went out before the deadline
    payloads = _payloads(resp.text)
    assert "[DONE]" not in payloads
    error = payloads[-1]["error"]
    assert error["type"] == "timeout_error" and error["code"] == "deadline_exceeded"
    assert time.monotonic() - started < strict_gateway.timeout_s + 2
    assert fake.observed.cancelled.wait(timeout=2.0), "the stream was not cancelled upstream"


def test_a_lost_frontend_fails_open_streams_and_a_new_one_is_used_when_back() -> None:
    first = FakeFrontend().start()
    port = first.port
    gateway = GatewayServer(GatewayConfig(frontend_addr=first.address, request_timeout_s=10))
    gateway.start()
    url = f"{gateway.url}/v1/chat/completions"
    try:
        first.servicer.script.hang_after = 1
        with (
            httpx.Client(timeout=10) as http,
            http.stream("POST", url, json=CHAT) as resp,
        ):
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")  # the first frame; the fake now hangs
            first.stop()  # the frontend goes away with the stream open
            rest = "\n\n".join(line for line in lines if line)
        error = _payloads(rest)[-1]["error"]
        assert error["code"] == "unavailable" and error["type"] == "service_unavailable_error"
        refused = httpx.post(url, json=CHAT, timeout=10)
        assert refused.status_code == 503  # nothing listens: a status, not a hang
        second = FakeFrontend(port=port).start()  # back on the same address
        try:
            deadline = time.monotonic() + 15
            resp = httpx.post(url, json=CHAT, timeout=10)
            while resp.status_code == 503 and time.monotonic() < deadline:
                time.sleep(0.2)  # the channel's reconnect backoff
                resp = httpx.post(url, json=CHAT, timeout=10)
            assert resp.status_code == 200 and _content(_payloads(resp.text)) == "".join(PIECES)
            assert second.servicer.observed.multiplex_calls == 1
        finally:
            second.stop()
    finally:
        gateway.stop()


def test_each_transport_reaches_the_frontend_its_own_way(
    stream_gateway_url: str, fake: FakeFrontendServicer, request: pytest.FixtureRequest
) -> None:
    headers = {"X-Request-Id": "rid-7"}
    url = f"{stream_gateway_url}/v1/chat/completions"
    resp = httpx.post(url, json=CHAT, headers=headers, timeout=10)
    assert _content(_payloads(resp.text)) == "".join(PIECES)
    assert fake.observed.last("ChatCompletionStream").request_id == "rid-7"  # in the body
    call_metadata = fake.observed.metadata[-1]
    if request.node.callspec.params["stream_gateway_url"] == "multiplex":
        # It rode the long-lived call, whose metadata names no request.
        assert "x-request-id" not in call_metadata
    else:
        assert call_metadata["x-request-id"] == "rid-7"
        assert fake.observed.multiplex_calls == 0
