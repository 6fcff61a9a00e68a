"""serve_multiplexed: one call's streams, their batching, ends, cancels, limits and drain.

The streams here are plain async generators standing in for the serving layer's
``*.stream`` (what the frontend's ``Multiplex`` opens); everything else is the real
module. The live stack's streams go through it in the gateway and integration tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from tokenline.v1 import frontend_pb2, openai_pb2

from services.common.errors import InvalidArgumentError, call_error, field_of
from services.frontend.multiplex import StreamBudget, serve_multiplexed
from tests.waiting import eventually

Frames = list[frontend_pb2.MuxFrame]


def chat_open(stream_id: int, label: str = "") -> frontend_pb2.MuxRequest:
    request = openai_pb2.ChatCompletionRequest(request_id=label or str(stream_id))
    return frontend_pb2.MuxRequest(stream_id=stream_id, chat=request)


def cancel(stream_id: int) -> frontend_pb2.MuxRequest:
    return frontend_pb2.MuxRequest(stream_id=stream_id, cancel=True)


class Call:
    """One Multiplex call driven from the test: requests in, batches out."""

    def __init__(self, open_stream, budget: StreamBudget | None = None) -> None:  # noqa: ANN001
        self.requests: asyncio.Queue[frontend_pb2.MuxRequest | None] = asyncio.Queue()
        self.batches = serve_multiplexed(
            self._requests(), open_stream, budget or StreamBudget(None)
        )
        self._next: asyncio.Future[frontend_pb2.MuxBatch] | None = None

    async def _requests(self) -> AsyncIterator[frontend_pb2.MuxRequest]:
        while (request := await self.requests.get()) is not None:
            yield request

    def _pull(self) -> asyncio.Future[frontend_pb2.MuxBatch]:
        """The pending read of the next batch; the first one starts the call's handler."""
        if self._next is None:
            self._next = asyncio.ensure_future(anext(self.batches))
        return self._next

    def send(self, *requests: frontend_pb2.MuxRequest | None) -> None:
        self._pull()
        for request in requests:
            self.requests.put_nowait(request)

    async def batch(self) -> Frames:
        try:
            batch = await asyncio.wait_for(asyncio.shield(self._pull()), 5)
        finally:
            if self._next is not None and self._next.done():
                self._next = None
        return list(batch.frames)

    async def frames_until_ends(self, count: int) -> Frames:
        frames: Frames = []
        while sum(f.WhichOneof("kind") == "end" for f in frames) < count:
            frames += await self.batch()
        return frames


class Stepped:
    """Streams that each send message i when step i is released: one engine step."""

    def __init__(self, messages: int) -> None:
        self.steps = [asyncio.Event() for _ in range(messages)]
        self.opened: list[str] = []
        self.closed: list[str] = []

    async def __call__(self, request: frontend_pb2.MuxRequest) -> AsyncIterator[object]:
        label = request.chat.request_id
        self.opened.append(label)
        try:
            for i, step in enumerate(self.steps):
                await step.wait()
                yield openai_pb2.ChatCompletionChunk(id=f"{label}-{i}")
        finally:
            self.closed.append(label)


def by_stream(frames: Frames) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for frame in frames:
        kind = frame.WhichOneof("kind")
        text = frame.chat.id if kind == "chat" else f"end:{frame.end.code}"
        out.setdefault(frame.stream_id, []).append(text)
    return out


async def test_one_batch_carries_every_streams_frame_of_a_step() -> None:
    streams = Stepped(messages=2)
    call = Call(streams)
    call.send(chat_open(1), chat_open(2), chat_open(3))
    await eventually(lambda: len(streams.opened) == 3, what="three open streams")
    streams.steps[0].set()
    first = await call.batch()
    assert by_stream(first) == {1: ["1-0"], 2: ["2-0"], 3: ["3-0"]}
    streams.steps[1].set()
    second = await call.batch()  # the last messages and the ends: one step, one batch
    assert by_stream(second) == {s: [f"{s}-1", "end:0"] for s in (1, 2, 3)}
    call.send(None)  # the client half-closes: nothing is open, so the call ends
    with pytest.raises(StopAsyncIteration):
        await call.batch()
    assert sorted(streams.closed) == ["1", "2", "3"]


async def test_a_cancel_closes_that_stream_only_and_it_sends_nothing_more() -> None:
    streams = Stepped(messages=2)
    call = Call(streams)
    call.send(chat_open(1), chat_open(2))
    streams.steps[0].set()
    assert by_stream(await call.batch()) == {1: ["1-0"], 2: ["2-0"]}
    call.send(cancel(1))
    await eventually(lambda: bool(streams.closed), what="a closed stream")
    assert streams.closed == ["1"]  # its generator ran its cleanup (upstream abort)
    streams.steps[1].set()
    assert by_stream(await call.frames_until_ends(1)) == {2: ["2-1", "end:0"]}


async def test_a_failed_stream_ends_with_its_status_and_field() -> None:
    async def failing(request: frontend_pb2.MuxRequest) -> AsyncIterator[object]:
        if request.stream_id == 1:
            raise InvalidArgumentError("must be in [0, 2]", field="temperature")
        if request.stream_id == 2:
            raise RuntimeError("secret internals")
        yield openai_pb2.ChatCompletionChunk(id="fine")

    call = Call(failing)
    call.send(chat_open(1), chat_open(2), chat_open(3))
    frames = await call.frames_until_ends(3)
    ends = {f.stream_id: f.end for f in frames if f.WhichOneof("kind") == "end"}
    invalid = call_error(ends[1])  # what the gateway raises for it
    assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(invalid) == "temperature"
    assert "must be in [0, 2]" in invalid.details()
    assert ends[2].code == grpc.StatusCode.INTERNAL.value[0]
    assert "secret" not in ends[2].message and "RuntimeError" in ends[2].message
    assert by_stream(frames)[3] == ["fine", "end:0"]


async def test_a_reused_id_and_a_request_without_a_body_are_refused() -> None:
    streams = Stepped(messages=1)
    call = Call(streams)
    call.send(chat_open(7, "first"), chat_open(7, "again"), frontend_pb2.MuxRequest(stream_id=8))
    refusals = await call.frames_until_ends(2)
    codes = {f.stream_id: f.end.code for f in refusals}
    assert codes == {
        7: grpc.StatusCode.ALREADY_EXISTS.value[0],
        8: grpc.StatusCode.INVALID_ARGUMENT.value[0],
    }
    streams.steps[0].set()  # the stream that holds id 7 goes on
    assert by_stream(await call.frames_until_ends(1)) == {7: ["first-0", "end:0"]}


async def test_streams_past_the_limit_are_resource_exhausted_until_one_ends() -> None:
    streams = Stepped(messages=1)
    budget = StreamBudget(limit=1)
    call = Call(streams, budget)
    call.send(chat_open(1), chat_open(2))
    refused = await call.frames_until_ends(1)
    assert [(f.stream_id, f.end.code) for f in refused] == [
        (2, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    ]
    streams.steps[0].set()
    await call.frames_until_ends(1)
    assert budget.live == 0
    call.send(chat_open(3))
    assert by_stream(await call.frames_until_ends(1)) == {3: ["3-0", "end:0"]}


async def test_draining_refuses_new_streams_and_ends_the_call_when_idle() -> None:
    streams = Stepped(messages=1)
    budget = StreamBudget(None)
    call = Call(streams, budget)
    call.send(chat_open(1))
    await eventually(lambda: streams.opened == ["1"], what="the stream in flight")
    await budget.begin_drain()
    call.send(chat_open(2))
    refused = await call.frames_until_ends(1)
    assert [(f.stream_id, f.end.code) for f in refused] == [
        (2, grpc.StatusCode.UNAVAILABLE.value[0])
    ]
    streams.steps[0].set()  # the stream in flight finishes, then the call ends
    assert by_stream(await call.frames_until_ends(1)) == {1: ["1-0", "end:0"]}
    with pytest.raises(StopAsyncIteration):
        await call.batch()


async def test_ending_the_call_cancels_every_open_stream() -> None:
    streams = Stepped(messages=1)
    call = Call(streams)
    call.send(chat_open(1), chat_open(2))
    await eventually(lambda: len(streams.opened) == 2, what="two open streams")
    pending = call._pull()
    pending.cancel()  # the gateway went away: grpc cancels the handler mid-wait
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert sorted(streams.closed) == ["1", "2"]
