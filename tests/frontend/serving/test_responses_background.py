"""Background responses, cancel and delete in-process: ResponsesServing over a scripted
chat stream (the chat path itself is tested live), so each state change is awaited on an
event, never on a clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, cast

import pytest
from tokenline.v1 import openai_pb2, responses_pb2

from services.common.auth.api_keys import ApiKey
from services.common.auth.caller import set_caller
from services.common.errors import InvalidArgumentError, NotFoundError
from services.frontend.serving.chat import ChatServing
from services.frontend.serving.responses import ResponsesServing
from tests.waiting import eventually


class ScriptedChat:
    """A chat stream: the role chunk, then one text chunk per ``release``, then the finish
    and usage chunks. Records whether each stream was closed early (an abort upstream)."""

    def __init__(self) -> None:
        self.pieces: asyncio.Queue[str | None] = asyncio.Queue()
        self.num_streams = 0
        self.closed_early = asyncio.Event()
        self.started = asyncio.Event()

    async def stream(self, request: Any) -> AsyncGenerator[openai_pb2.ChatCompletionChunk, None]:
        self.num_streams += 1
        label = f"chatcmpl-r{self.num_streams}"
        chunk = openai_pb2.ChatCompletionChunk
        finished = False
        try:
            yield chunk(id=label, model="m", created=1, choices=[{"delta": {"role": "assistant"}}])
            self.started.set()
            while (piece := await self.pieces.get()) is not None:
                yield chunk(id=label, choices=[{"delta": {"content": piece}}])
            yield chunk(id=label, choices=[{"delta": {}, "finish_reason": "stop"}])
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            yield chunk(id=label, usage=usage)
            finished = True
        finally:
            if not finished:
                self.closed_early.set()


@pytest.fixture
def chat() -> ScriptedChat:
    return ScriptedChat()


@pytest.fixture
def serving(chat: ScriptedChat) -> ResponsesServing:
    return ResponsesServing(cast(ChatServing, chat))


def _background(**fields: Any) -> responses_pb2.ResponsesRequest:
    return responses_pb2.ResponsesRequest(input_text="hi", background=True, **fields)


async def test_a_background_response_answers_in_progress_then_completes(
    serving: ResponsesServing, chat: ScriptedChat
) -> None:
    created = await serving.create(_background())
    assert created.status == "in_progress" and created.background and not created.output
    for piece in ("Hel", "lo", None):
        chat.pieces.put_nowait(piece)
    await eventually(lambda: serving.get(created.id).status != "in_progress", what="the end")
    done = serving.get(created.id)
    assert done.status == "completed" and done.output[0].content[0].text == "Hello"
    assert done.usage.total_tokens == 5 and not chat.closed_early.is_set()
    with pytest.raises(InvalidArgumentError) as info:
        serving.cancel(created.id)
    assert info.value.message == "Cannot cancel a response that is already completed."
    listed = serving.input_items(responses_pb2.ResponsesInputItemsRequest(response_id=created.id))
    assert [(i.type, i.role, i.content[0].text) for i in listed.data] == [("message", "user", "hi")]


async def test_cancel_aborts_the_run_and_is_idempotent(
    serving: ResponsesServing, chat: ScriptedChat
) -> None:
    created = await serving.create(_background())
    cancelled = serving.cancel(created.id)
    assert cancelled.status == "cancelled"
    await chat.closed_early.wait()  # the stream was closed: its choices aborted upstream
    assert serving.cancel(created.id).status == "cancelled"
    assert serving.get(created.id).status == "cancelled"
    with pytest.raises(InvalidArgumentError) as info:
        await serving.create(
            responses_pb2.ResponsesRequest(input_text="x", previous_response_id=created.id)
        )
    assert info.value.field == "previous_response_id" and "cancelled" in info.value.message


async def test_deleting_a_running_response_aborts_it(
    serving: ResponsesServing, chat: ScriptedChat
) -> None:
    created = await serving.create(_background())
    await chat.started.wait()
    deleted = serving.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "response", True)
    await chat.closed_early.wait()
    with pytest.raises(Exception) as info:
        serving.get(created.id)
    assert created.id in str(info.value)


async def test_a_synchronous_response_cannot_be_cancelled(
    serving: ResponsesServing, chat: ScriptedChat
) -> None:
    chat.pieces.put_nowait(None)
    events = [e async for e in serving.stream(responses_pb2.ResponsesRequest(input_text="x"))]
    response_id = events[-1].response.id
    with pytest.raises(InvalidArgumentError) as info:
        serving.cancel(response_id)
    assert info.value.message == "Cannot cancel a synchronous response."
    assert info.value.field == "response_id"


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_background(store=False), "store"),
        (responses_pb2.ResponsesRequest(input_text="x", previous_response_id="resp_nope"), None),
    ],
)
async def test_refusals_come_before_anything_is_dispatched(
    serving: ResponsesServing, chat: ScriptedChat, request_: Any, field: str | None
) -> None:
    with pytest.raises(Exception) as info:
        await serving.create(request_)
    assert getattr(info.value, "field", None) == (field or "previous_response_id")
    assert chat.num_streams == 0


def _replay(response_id: str, after: int | None = None) -> Any:
    request = responses_pb2.ResponsesGetStreamRequest(response_id=response_id)
    if after is not None:
        request.starting_after = after
    return request


async def test_a_streamed_background_response_runs_on_when_its_caller_leaves(
    serving: ResponsesServing, chat: ScriptedChat
) -> None:
    stream = serving.stream(_background())
    first = [await anext(stream), await anext(stream)]
    assert [e.type for e in first] == ["response.created", "response.in_progress"]
    response_id = first[0].response.id
    await stream.aclose()  # the caller leaves
    for piece in ("Hel", "lo", None):
        chat.pieces.put_nowait(piece)
    replayed = [e async for e in serving.replay(_replay(response_id, 1))]
    assert [e.sequence_number for e in replayed] == list(range(2, 2 + len(replayed)))
    assert replayed[-1].type == "response.completed" and not chat.closed_early.is_set()
    deltas = [e.delta for e in replayed if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "Hello" == serving.get(response_id).output[0].content[0].text
    everything = [e async for e in serving.replay(_replay(response_id))]
    assert [e.sequence_number for e in everything] == list(range(len(everything)))
    assert everything[2:] == replayed


async def test_a_cancelled_run_ends_its_replay_with_a_cancelled_event(
    serving: ResponsesServing, chat: ScriptedChat
) -> None:
    created = await serving.create(_background())
    follower = serving.replay(_replay(created.id))
    assert (await anext(follower)).type == "response.created"
    serving.cancel(created.id)
    rest = [e async for e in follower]
    assert rest[-1].type == "response.cancelled" and rest[-1].response.status == "cancelled"


async def test_only_a_background_response_is_replayed(
    serving: ResponsesServing, chat: ScriptedChat
) -> None:
    chat.pieces.put_nowait(None)
    events = [e async for e in serving.stream(responses_pb2.ResponsesRequest(input_text="x"))]
    response = serving.get(events[-1].response.id)  # stored, streamed, not in the background
    with pytest.raises(InvalidArgumentError) as info:
        await anext(serving.replay(_replay(response.id)))
    assert info.value.field == "stream" and response.id in info.value.message
    with pytest.raises(NotFoundError) as missing:
        await anext(serving.replay(_replay("resp_nope")))
    assert missing.value.field == "response_id" and "resp_nope" in missing.value.message


async def test_another_keys_stored_response_is_not_found_for_every_call(
    serving: ResponsesServing, chat: ScriptedChat
) -> None:
    """As for ResponsesGet: a response belongs to the key that made it."""
    set_caller(ApiKey("alice", "user", b"a"))
    created = await serving.create(_background())
    set_caller(ApiKey("bob", "user", b"b"))
    page = responses_pb2.ResponsesInputItemsRequest(response_id=created.id)
    for call in (
        lambda: serving.get(created.id),
        lambda: serving.input_items(page),
        lambda: serving.cancel(created.id),
        lambda: serving.delete(created.id),
    ):
        with pytest.raises(NotFoundError) as info:
            call()
        assert info.value.field == "response_id" and created.id in info.value.message
    assert not chat.closed_early.is_set()  # bob's cancel and delete did nothing
    set_caller(ApiKey("root", "admin", b"r"))
    assert serving.cancel(created.id).status == "cancelled"
    await chat.closed_early.wait()
