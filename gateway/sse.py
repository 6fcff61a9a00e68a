"""Server-sent events: every streaming route's one responder.

``respond`` chooses between the streaming RPC, framed as SSE, and the unary RPC's answer
as one JSON body. How a stream's messages become bytes is the route's ``Framer``: OpenAI's
``data:`` frames ending in ``data: [DONE]`` (``DataFrames``, chat, completions and
``/generate``), Anthropic's events (``gateway/anthropic/render.py``), the Responses API's
typed events (``gateway/responses_api/render.py``). A failure after the first frame cannot
change the HTTP status any more, so the framer says it in its protocol's words (OpenAI's
``data: {"error": {...}}``, which the SDK raises as APIError; an ``error`` event) and the
stream ends there.

A stream that stays silent for ``--sse-keepalive`` seconds (a request waiting in a busy
scheduler's queue) gets the framer's keep-alive (an SSE comment, or Anthropic's ``ping``
event), so proxies with idle timeouts keep the connection; clients skip it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from gateway.client import StreamCall, until_disconnected
from gateway.errors import GatewayError, from_rpc_error
from gateway.render.text_frames import TextFrames, TextSlot
from gateway.responses import JsonBody

logger = logging.getLogger(__name__)

DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE_COMMENT = b": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Render = Callable[[Any], dict[str, Any] | JsonBody]


class Framer(Protocol):
    """One stream's bytes, message by message: stateful, one per stream. ``event`` for
    each message, then ``end()`` after a clean end or ``fail(error)`` in its place;
    ``keepalive()`` at any point between frames."""

    def event(self, message: Any) -> bytes: ...

    def end(self) -> bytes: ...

    def fail(self, err: GatewayError) -> bytes: ...

    def keepalive(self) -> bytes: ...


def sse_frame(payload: dict[str, Any] | JsonBody) -> bytes:
    """One ``data:`` frame; a response model serialises itself (the per-token path)."""
    if isinstance(payload, JsonBody):
        return b"data: " + payload.dump_json() + b"\n\n"
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return b"data: " + text.encode("utf-8") + b"\n\n"


def error_frame(err: GatewayError) -> bytes:
    return sse_frame(err.body())


class DataFrames:
    """OpenAI's framing: a ``data: {json}`` frame per message, ``data: [DONE]`` at a clean
    end. With ``text_slot``, a chunk that carries only new text is written from a template
    (``render/text_frames.py``): the same bytes, without the models."""

    __slots__ = ("event",)

    def __init__(self, render: Render, text_slot: TextSlot | None = None) -> None:
        def frame(message: Any) -> bytes:
            return sse_frame(render(message))

        self.event: Callable[[Any], bytes] = (
            frame if text_slot is None else TextFrames(frame, text_slot)
        )

    def end(self) -> bytes:
        return DONE_FRAME

    def fail(self, err: GatewayError) -> bytes:
        return error_frame(err)

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT


async def relay(call: StreamCall, first: Any, framer: Framer) -> AsyncIterator[bytes]:
    """Frames for `first` and every later message, then the end, or the failure when the
    call fails; the call is cancelled however this ends.

    Starlette cancels this generator when the client disconnects; the `finally`
    then cancels the RPC, which the frontend sees as CancelledError and aborts.
    """
    event = framer.event
    try:
        message = first
        while message is not grpc.aio.EOF:
            yield event(message)
            message = await call.read()
        yield framer.end()
    except grpc.aio.AioRpcError as exc:
        yield framer.fail(from_rpc_error(exc))
    except Exception:
        logger.exception("stream relay failed")
        yield framer.fail(GatewayError(500, "internal error while streaming"))
    finally:
        call.cancel()


class SseResponse(StreamingResponse):
    """``text/event-stream`` from ``frames``; after ``keepalive_s`` seconds without a frame
    (None: never) the framer's keep-alive is sent. The beat is a timer task per stream, so
    a frame costs only a counter; a keep-alive never lands inside a frame (each frame is
    one ``send``, and the two senders take turns)."""

    def __init__(self, frames: AsyncIterator[bytes], framer: Framer, keepalive_s: float | None):
        super().__init__(frames, media_type="text/event-stream", headers=SSE_HEADERS)
        self._framer = framer
        self._keepalive_s = keepalive_s
        self._num_sent = 0
        self._sending = asyncio.Lock()

    async def stream_response(self, send: Send) -> None:
        if self._keepalive_s is None:
            return await super().stream_response(send)
        start = {"type": "http.response.start", "status": self.status_code}
        await send(start | {"headers": self.raw_headers})
        beat = asyncio.ensure_future(self._beat(send, self._keepalive_s))
        try:
            async for chunk in self.body_iterator:
                self._num_sent += 1
                async with self._sending:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            beat.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _beat(self, send: Send, interval_s: float) -> None:
        seen = -1
        with contextlib.suppress(OSError):  # the client left: the stream will notice
            while True:
                await asyncio.sleep(interval_s)
                if self._num_sent == seen:
                    body = self._framer.keepalive()
                    async with self._sending:
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                seen = self._num_sent


async def stream_response(
    request: Request, call: StreamCall, framer: Framer, keepalive_s: float | None = None
) -> StreamingResponse:
    """Wait for the first message so errors before any output get a real HTTP status."""
    try:
        first = await until_disconnected(request, call.read(), call)
    except BaseException:
        call.cancel()
        raise
    return SseResponse(relay(call, first, framer), framer, keepalive_s)


async def respond(
    request: Request,
    *,
    stream: bool,
    start_stream: Callable[[], StreamCall],
    start_unary: Callable[[], grpc.aio.UnaryUnaryCall],
    framer: Framer,
    render_whole: Callable[[Any], Any],
) -> Response:
    """SSE frames from the streaming RPC (framed by ``framer``) when the client asked to
    stream, else the unary RPC's answer as one JSON body (an object, or a list for SGLang's
    batches). Only the RPC chosen is started."""
    if stream:
        keepalive_s = request.state.config.sse_keepalive_s
        return await stream_response(request, start_stream(), framer, keepalive_s)
    call = start_unary()
    return JSONResponse(render_whole(await until_disconnected(request, call, call)))
