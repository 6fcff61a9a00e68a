"""Plain text chunks written from a template are byte-for-byte the frames the response
models write, for any text, and every other chunk still goes through the models."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenline.v1 import openai_pb2

from gateway.render.openai import chat_chunk, text_completion
from gateway.render.text_frames import (
    _MARKER,
    CHAT_TEXT,
    COMPLETION_TEXT,
    TextFrames,
    TextSlot,
)
from gateway.sse import sse_frame

SHAPES = [
    {"include_usage": usage, "logprobs": logprobs, "debug": debug}
    for usage in (False, True)
    for logprobs in (False, True)
    for debug in (False, True)
]


class CountingFrame:
    """``sse_frame(render(chunk))``, counting the chunks the models rendered."""

    def __init__(self, render: Callable[[Any], Any]) -> None:
        self.render = render
        self.calls = 0

    def __call__(self, chunk: Any) -> bytes:
        self.calls += 1
        return sse_frame(self.render(chunk))


def chat_stream(texts: list[str], chunk_id: str = "chatcmpl-1") -> list[Any]:
    def chunk() -> openai_pb2.ChatCompletionChunk:
        return openai_pb2.ChatCompletionChunk(
            id=chunk_id, object="chat.completion.chunk", created=1_700_000_000, model="m"
        )

    head = chunk()
    head.choices.add(index=0).delta.role = "assistant"
    with_prompt_ids = chunk()  # return_token_ids: on the first content chunk
    with_prompt_ids.choices.add(index=0).delta.content = "p"
    with_prompt_ids.prompt_token_ids.extend([1, 2])
    body = [with_prompt_ids]
    for text in texts:
        c = chunk()
        c.choices.add(index=0).delta.content = text
        body.append(c)
    with_logprobs = chunk()
    choice = with_logprobs.choices.add(index=0)
    choice.delta.content = "x"
    choice.logprobs.content.add(token="x", logprob=-0.5)
    last = chunk()
    last.choices.add(index=0, finish_reason="stop").delta.content = "end"
    last.times.received = 1.0
    usage = chunk()
    usage.usage.prompt_tokens, usage.usage.completion_tokens = 3, len(texts) + 2
    return [head, *body, with_logprobs, last, usage]


def completion_stream(texts: list[str]) -> list[Any]:
    def chunk() -> openai_pb2.CompletionChunk:
        return openai_pb2.CompletionChunk(
            id="cmpl-1", object="text_completion", created=1_700_000_000, model="m"
        )

    out = []
    for i, text in enumerate(texts):
        c = chunk()
        c.choices.add(index=i % 2, text=text)  # two choices (n = 2) interleaved
        out.append(c)
    ids = chunk()
    ids.choices.add(index=0, text="y").token_ids.extend([5, 6])
    last = chunk()
    last.choices.add(index=1, text="", finish_reason="length")
    return [*out, ids, last]


texts = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6)


KINDS = [
    pytest.param(chat_chunk, CHAT_TEXT, chat_stream, id="chat"),
    pytest.param(text_completion, COMPLETION_TEXT, completion_stream, id="completion"),
]


@pytest.mark.parametrize(("render", "slot", "stream"), KINDS)
@settings(max_examples=60, deadline=None)
@given(texts=texts)
def test_frames_are_the_models_bytes(
    render: Callable[..., Any],
    slot: TextSlot,
    stream: Callable[[list[str]], list[Any]],
    texts: list[str],
) -> None:
    for shape in SHAPES:
        chunks = stream(texts)
        frames = TextFrames(CountingFrame(partial(render, **shape)), slot)
        expected = [sse_frame(render(c, **shape)) for c in chunks]
        assert [frames(c) for c in chunks] == expected


def test_plain_chunks_skip_the_models_after_one_template_per_choice() -> None:
    texts = ["a", "b\n", 'c"', "é\u2028", "\x00\x1f"]
    counting = CountingFrame(partial(chat_chunk, include_usage=True, logprobs=False))
    frames = TextFrames(counting, CHAT_TEXT)
    for c in chat_stream(texts):
        frames(c)
    # role, prompt ids, the template, logprobs, finish, usage: five plain chunks, one render.
    assert counting.calls == 6

    counting = CountingFrame(partial(text_completion, include_usage=False, logprobs=False))
    frames = TextFrames(counting, COMPLETION_TEXT)
    for c in completion_stream(texts):
        frames(c)
    assert counting.calls == 2 + 2  # a template for each of the two choices, token ids, finish


@pytest.mark.parametrize("chunk_id", [_MARKER, "chatcmpl-plain"])
def test_a_marker_that_is_not_unique_falls_back_to_the_models(chunk_id: str) -> None:
    render = partial(chat_chunk, include_usage=False, logprobs=False)
    counting = CountingFrame(render)
    frames = TextFrames(counting, CHAT_TEXT)
    chunks = chat_stream(["one", "two", _MARKER], chunk_id)
    assert [frames(c) for c in chunks] == [sse_frame(render(c)) for c in chunks]
    # Templated: role, prompt ids, template, logprobs, finish, usage. Not: the failed
    # template too, and each of the three plain chunks.
    assert counting.calls == (6 if chunk_id == "chatcmpl-plain" else 9)


def test_a_chunk_without_created_is_never_templated() -> None:
    """The models write the current time for it, which a template would freeze."""
    counting = CountingFrame(partial(text_completion, include_usage=False, logprobs=False))
    frames = TextFrames(counting, COMPLETION_TEXT)
    for text in ("a", "b", "c"):
        frames(openai_pb2.CompletionChunk(id="cmpl-1", model="m", choices=[{"text": text}]))
    assert counting.calls == 3
