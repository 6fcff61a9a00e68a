"""How bench/serve turns SSE chunks into timings and request bodies (no server needed)."""

from __future__ import annotations

import pytest

from bench.serve.client import (
    ChunkTimer,
    RequestResult,
    RequestSettings,
    StreamError,
    chunk_text,
    request_body,
    request_url,
)
from bench.serve.datasets import BenchPrompt

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}


def delta(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_ttft_and_itl_come_from_text_chunks_only() -> None:
    timer = ChunkTimer(RequestResult(start_s=0.0), sent_at=10.0)
    for chunk, now in [
        (ROLE, 10.05),
        (delta("a"), 10.2),
        (delta("bc"), 10.25),
        (delta(""), 10.3),
        (delta("d"), 10.4),
        (USAGE, 10.41),
    ]:
        timer.on_chunk(chunk, now)
    result = timer.finish(10.5)
    assert result.success and result.text == "abcd"
    assert result.ttft_s == pytest.approx(0.2)
    assert result.itl_s == pytest.approx([0.05, 0.15])
    assert result.e2e_s == pytest.approx(0.5)
    assert (result.prompt_tokens, result.output_tokens) == (7, 3)
    assert result.is_usage_from_server


def test_completion_chunks_and_usage_on_the_finish_chunk() -> None:
    """transformers serve puts usage on its finish chunk and sends no [DONE]."""
    timer = ChunkTimer(RequestResult(start_s=0.0), sent_at=0.0)
    timer.on_chunk({"choices": [{"index": 0, "text": "x"}]}, 0.1)
    finish = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    timer.on_chunk(finish | {"usage": {"prompt_tokens": 2, "completion_tokens": 1}}, 0.2)
    result = timer.finish(0.2)
    assert (result.ttft_s, result.output_tokens, result.itl_s) == (0.1, 1, [])


def test_error_frames_and_empty_streams_fail() -> None:
    timer = ChunkTimer(RequestResult(start_s=0.0), sent_at=0.0)
    with pytest.raises(StreamError, match="KV cache full"):
        timer.on_chunk({"error": {"message": "KV cache full", "code": 503}}, 0.1)
    with pytest.raises(StreamError, match="without generated text"):
        ChunkTimer(RequestResult(start_s=0.0), sent_at=0.0).finish(1.0)


def test_chunk_text_reads_content_reasoning_and_text() -> None:
    assert chunk_text(delta("hi")) == "hi"
    assert chunk_text({"choices": [{"delta": {"reasoning_content": "hm"}}]}) == "hm"
    assert chunk_text({"choices": [{"text": "t"}]}) == "t"
    assert chunk_text(USAGE) == ""


def test_request_bodies() -> None:
    prompt = BenchPrompt(user="q", prompt_len=1, output_len=5, system="sys ", group=0)
    chat = RequestSettings(base_url="http://h/v1/", model="m")
    body = request_body(chat, prompt)
    assert request_url(chat) == "http://h/v1/chat/completions"
    assert body["messages"] == [
        {"role": "system", "content": "sys "},
        {"role": "user", "content": "q"},
    ]
    assert (body["max_tokens"], body["ignore_eos"], body["stream"]) == (5, True, True)
    assert body["stream_options"] == {"include_usage": True}
    plain = RequestSettings(
        base_url="http://h/v1", model="m", endpoint="completions", ignore_eos=False
    )
    body = request_body(plain, prompt)
    assert request_url(plain) == "http://h/v1/completions"
    assert body["prompt"] == "sys q" and "ignore_eos" not in body and "messages" not in body


def test_the_stage_breakdown_of_a_finish_chunk_is_kept() -> None:
    timer = ChunkTimer(RequestResult(start_s=0.0), sent_at=0.0)
    timer.on_chunk({"choices": [{"delta": {"content": "hi"}}]}, 0.1)
    finish = {"choices": [{"delta": {}, "finish_reason": "length"}]}
    timer.on_chunk(finish | {"debug": {"stages_ms": {"dispatch": 1.5, "queue": 3.0}}}, 0.2)
    assert timer.finish(0.3).stages_ms == {"dispatch": 1.5, "queue": 3.0}
