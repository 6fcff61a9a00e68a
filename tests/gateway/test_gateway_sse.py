"""Raw SSE bytes from the gateway: framing, ordering, headers, errors, disconnects."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest
from fake_frontend import PIECES, FakeFrontendServicer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _frames(raw: bytes) -> list[str]:
    """Split an SSE body into `data:` payloads, checking the framing on the way."""
    assert raw.endswith(b"\n\n")
    events = raw.decode().split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e.removeprefix("data: ") for e in events]


def _post_stream(url: str, body: dict[str, Any]) -> tuple[httpx.Response, list[str]]:
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
    return resp, _frames(resp.content)


def test_chat_stream_frames_and_headers(stream_gateway_url: str) -> None:
    body = CHAT | {"n": 2, "stream_options": {"include_usage": True}}
    resp, frames = _post_stream(stream_gateway_url, body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache"
    assert resp.headers["x-accel-buffering"] == "no"
    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    chunks = [json.loads(f) for f in frames[:-1]]
    first = chunks[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert first["finish_reason"] is None and first["logprobs"] is None
    finishes = [(c["index"], c["finish_reason"]) for ch in chunks for c in ch["choices"]]
    assert sorted(f for f in finishes if f[1] is not None) == [(0, "stop"), (1, "stop")]
    assert all(ch["usage"] is None for ch in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 7
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)


def test_chat_stream_without_usage_has_no_usage_key(stream_gateway_url: str) -> None:
    _, frames = _post_stream(stream_gateway_url, CHAT)
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all("usage" not in ch and ch["choices"] for ch in chunks)
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == "".join(PIECES)


def test_completion_stream_frames(stream_gateway_url: str) -> None:
    body = {"model": "m", "prompt": "p", "stream": True}
    resp = httpx.post(f"{stream_gateway_url}/v1/completions", json=body, timeout=10)
    frames = _frames(resp.content)
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" for c in chunks)


def test_error_before_first_frame_is_http_status(
    stream_gateway_url: str, fake: FakeFrontendServicer
) -> None:
    fake.script.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    fake.script.fail_message = "temperature: must be in [0, 2]"
    fake.script.fail_field = "temperature"
    resp = httpx.post(f"{stream_gateway_url}/v1/chat/completions", json=CHAT, timeout=10)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "temperature"


def test_mid_stream_error_is_one_error_frame_then_end(
    stream_gateway_url: str, fake: FakeFrontendServicer
) -> None:
    fake.script.fail_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    fake.script.fail_message = "kv cache full"
    fake.script.fail_after = 1
    resp, frames = _post_stream(stream_gateway_url, CHAT)
    assert resp.status_code == 200
    assert len(frames) == 2 and "[DONE]" not in frames
    assert "choices" in json.loads(frames[0])
    error = json.loads(frames[1])["error"]
    assert error == {
        "message": "kv cache full",
        "type": "rate_limit_error",
        "param": None,
        "code": "resource_exhausted",
    }


def test_generate_stream_frames(stream_gateway_url: str) -> None:
    body = {"text": "p", "stream": True}
    resp = httpx.post(f"{stream_gateway_url}/generate", json=body, timeout=10)
    frames = _frames(resp.content)
    assert frames[-1] == "[DONE]"
    # SGLang's shape: a single prompt streams bare output objects, text so far in each.
    first = json.loads(frames[0])
    assert first["text"] == "".join(PIECES) and "index" not in first


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_client_disconnect_cancels_grpc_call(
    stream_gateway_url: str, fake: FakeFrontendServicer, path: str
) -> None:
    fake.script.hang_after = 1
    body = CHAT if "chat" in path else {"model": "m", "prompt": "p", "stream": True}
    async with (
        httpx.AsyncClient(timeout=10) as http,
        http.stream("POST", f"{stream_gateway_url}{path}", json=body) as resp,
    ):
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break  # the first frame arrived; the fake now hangs
        assert not fake.observed.cancelled.is_set()
    # The fake hangs for good: only the cancel can set this (the bound only ends a failure).
    assert fake.observed.cancelled.wait(timeout=30.0), "frontend call was not cancelled"


async def test_client_disconnect_cancels_unary_call(
    stream_gateway_url: str, fake: FakeFrontendServicer
) -> None:
    fake.script.delay_s = 30
    body = CHAT | {"stream": False}
    async with httpx.AsyncClient(timeout=0.3) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{stream_gateway_url}/v1/chat/completions", json=body)
    assert fake.observed.cancelled.wait(timeout=2.0), "unary frontend call was not cancelled"


KEEPALIVE_CASES = [
    ("/v1/chat/completions", CHAT, b": keep-alive\n\n"),
    (
        "/v1/messages",
        {"model": "m", "max_tokens": 8, "stream": True, "messages": CHAT["messages"]},
        b'event: ping\ndata: {"type":"ping"}\n\n',
    ),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True}, b": keep-alive\n\n"),
]


@pytest.mark.parametrize(("path", "body", "keepalive"), KEEPALIVE_CASES)
async def test_a_silent_stream_gets_keepalives_between_whole_frames(
    keepalive_gateway_url: str,
    fake: FakeFrontendServicer,
    path: str,
    body: dict[str, Any],
    keepalive: bytes,
) -> None:
    """The fake sends two messages and then nothing: the stream carries on with the
    route's keep-alive (read until three came; each wait is on bytes, not on a clock),
    every one between whole frames, and leaving still cancels the call upstream."""
    fake.script.hang_after = 2
    raw = b""
    async with (
        httpx.AsyncClient(timeout=10) as http,
        http.stream("POST", f"{keepalive_gateway_url}{path}", json=body) as resp,
    ):
        assert resp.status_code == 200
        async for part in resp.aiter_bytes():
            raw += part
            if raw.endswith(keepalive * 3):
                break
    frames = [frame + b"\n\n" for frame in raw.split(b"\n\n")]
    assert frames.pop() == b"\n\n"  # the bytes read end at a frame's end
    assert frames[-3:] == [keepalive] * 3
    others = [f for f in frames if f != keepalive]
    assert others and all(f.startswith((b"data: ", b"event: ")) for f in others)
    assert fake.observed.cancelled.wait(timeout=30.0), "frontend call was not cancelled"


async def test_no_keepalive_while_frames_flow(keepalive_gateway_url: str) -> None:
    """A stream that never goes silent is the frames alone."""
    resp = httpx.post(f"{keepalive_gateway_url}/v1/chat/completions", json=CHAT, timeout=10)
    assert _frames(resp.content)[-1] == "[DONE]"
