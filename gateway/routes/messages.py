"""Anthropic's Messages API: one route, translated onto the frontend's ChatCompletion RPC."""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response

from gateway.anthropic.convert import messages_request_to_proto
from gateway.anthropic.render import MessageEvents, message_to_dict
from gateway.anthropic.responses import AnthropicErrorResponse, MessageResponse
from gateway.anthropic.schemas import MessagesBody
from gateway.client import FrontendClient
from gateway.extra_fields import check_extra_fields
from gateway.openapi import GENERATION_ERRORS, error_responses
from gateway.sse import respond

router = APIRouter(tags=["anthropic"])

_STREAM_NOTE = (
    " With `stream: true`: `text/event-stream` with Anthropic's events (`message_start`, "
    "`content_block_start`, `content_block_delta`, `content_block_stop`, `message_delta`, "
    "`message_stop`), with a `ping` event after `message_start` and on a silent stream "
    "every `--sse-keepalive` seconds; an error after the first event is one `error` event."
)


def _responses() -> dict[int | str, dict[str, Any]]:
    errors = error_responses(GENERATION_ERRORS)
    for documented in errors.values():
        documented["model"] = AnthropicErrorResponse
    ok = {"model": MessageResponse, "description": "A message." + _STREAM_NOTE}
    return {200: ok, **errors}


@router.post("/v1/messages", response_model=None, responses=_responses())
async def messages(body: MessagesBody, request: Request) -> Response:
    """Anthropic Messages; errors in Anthropic's shape (``gateway/anthropic_errors.py``)."""
    client: FrontendClient = request.state.frontend
    rid: str = request.state.request_id
    proto = messages_request_to_proto(body, rid)  # first: it names a refused block's type
    check_extra_fields(body)
    stop_sequences = list(proto.sampling.stop)
    return await respond(
        request,
        stream=body.stream,
        start_stream=client.stream_starter("chat", proto, rid),
        start_unary=partial(client.stub.ChatCompletion, proto, **client.options(rid)),
        framer=MessageEvents(stop_sequences),
        render_whole=partial(message_to_dict, stop_sequences=stop_sequences),
    )
