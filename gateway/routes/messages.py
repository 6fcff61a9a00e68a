"""Anthropic's Messages API: one route, translated onto the frontend's ChatCompletion RPC."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from gateway.anthropic.convert import messages_request_to_proto
from gateway.anthropic.render import MessageEvents, message_to_dict
from gateway.anthropic.responses import AnthropicErrorResponse, MessageResponse
from gateway.anthropic.schemas import MessagesBody
from gateway.client import FrontendClient, until_disconnected
from gateway.extra_fields import check_extra_fields
from gateway.openapi import GENERATION_ERRORS, error_responses
from gateway.sse import stream_response

router = APIRouter(tags=["anthropic"])

_STREAM_NOTE = (
    " With `stream: true`: `text/event-stream` with Anthropic's events (`message_start`, "
    "`content_block_start`, `content_block_delta`, `content_block_stop`, `message_delta`, "
    "`message_stop`); an error after the first event is one `error` event."
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
    if body.stream:
        events = MessageEvents(stop_sequences)
        call = client.stream_starter("chat", proto, rid)()
        return await stream_response(request, call, events, end=events.end, fail=events.fail)
    unary = client.stub.ChatCompletion(proto, **client.options(rid))
    completion = await until_disconnected(request, unary, unary)
    return JSONResponse(message_to_dict(completion, stop_sequences))
