"""Server-sent events: OpenAI's framing of a gRPC server stream; and `respond`, every
generation route's one choice between that stream and a single JSON body.

Each message is one `data: {json}` frame and a clean end is `data: [DONE]`. A
failure after the first frame cannot change the HTTP status any more, so it is
sent as one `data: {"error": {...}}` frame (the OpenAI SDK raises it as APIError)
and the stream ends without `[DONE]`. Another protocol's stream (Anthropic's events)
passes its own ``end`` and ``fail`` framing to the same relay.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import Message
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.client import StreamCall, until_disconnected
from gateway.errors import GatewayError, from_rpc_error
from gateway.render.text_frames import Frame, TextFrames, TextSlot
from gateway.responses import JsonBody

logger = logging.getLogger(__name__)

DONE_FRAME = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Render = Callable[[Any], dict[str, Any] | JsonBody]


def sse_frame(payload: dict[str, Any] | JsonBody) -> bytes:
    """One ``data:`` frame; a response model serialises itself (the per-token path)."""
    if isinstance(payload, JsonBody):
        return b"data: " + payload.dump_json() + b"\n\n"
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return b"data: " + text.encode("utf-8") + b"\n\n"


def done_frame() -> bytes:
    return DONE_FRAME


def error_frame(err: GatewayError) -> bytes:
    return sse_frame(err.body())


async def relay(
    call: StreamCall,
    first: Message | Any,
    frame: Frame,
    *,
    end: Callable[[], bytes] = done_frame,
    fail: Callable[[GatewayError], bytes] = error_frame,
) -> AsyncIterator[bytes]:
    """Frames for `first` and every later message, then `end()`, or `fail(error)` when the
    call fails; the call is cancelled however this ends.

    Starlette cancels this generator when the client disconnects; the `finally`
    then cancels the RPC, which the frontend sees as CancelledError and aborts.
    """
    try:
        message = first
        while message is not grpc.aio.EOF:
            yield frame(message)
            message = await call.read()
        yield end()
    except grpc.aio.AioRpcError as exc:
        yield fail(from_rpc_error(exc))
    except Exception:
        logger.exception("stream relay failed")
        yield fail(GatewayError(500, "internal error while streaming"))
    finally:
        call.cancel()


async def stream_response(
    request: Request,
    call: StreamCall,
    frame: Frame,
    *,
    end: Callable[[], bytes] = done_frame,
    fail: Callable[[GatewayError], bytes] = error_frame,
) -> StreamingResponse:
    """Wait for the first message so errors before any output get a real HTTP status;
    `end` and `fail` as for `relay`."""
    try:
        first = await until_disconnected(request, call.read(), call)
    except BaseException:
        call.cancel()
        raise
    return StreamingResponse(
        relay(call, first, frame, end=end, fail=fail),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


async def respond(
    request: Request,
    *,
    stream: bool,
    start_stream: Callable[[], StreamCall],
    start_unary: Callable[[], grpc.aio.UnaryUnaryCall],
    render_frame: Render,
    render_whole: Callable[[Any], Any],
    text_slot: TextSlot | None = None,
) -> Response:
    """SSE frames from the streaming RPC when the client asked to stream, else the unary
    RPC's answer as one JSON body (an object, or a list for SGLang's batches). Only the
    RPC chosen is started. With ``text_slot``, a chunk that carries only new text is
    written from a template (``render/text_frames.py``): the same bytes, without the models."""
    if stream:

        def frame(message: Any) -> bytes:
            return sse_frame(render_frame(message))

        framer = frame if text_slot is None else TextFrames(frame, text_slot)
        return await stream_response(request, start_stream(), framer)
    call = start_unary()
    return JSONResponse(render_whole(await until_disconnected(request, call, call)))
