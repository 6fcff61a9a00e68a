"""OpenAI's Responses API: one route onto the frontend's ResponsesCreate RPCs."""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response
from tokenline.v1 import responses_pb2

from gateway.client import FrontendClient, until_disconnected
from gateway.extra_fields import check_extra_fields
from gateway.openapi import GENERATION_ERRORS, READ_ERRORS, error_responses, responses
from gateway.responses_api.bodies import ResponseObject
from gateway.responses_api.convert import responses_request_to_proto
from gateway.responses_api.render import ResponseFrames, response_to_dict
from gateway.responses_api.schemas import ResponsesBody
from gateway.sse import respond

router = APIRouter(tags=["openai"])

_STREAM_NOTE = (
    " With `stream: true`: `text/event-stream`, one `event: <type>` / `data: {json}` frame "
    "per event, each with its `sequence_number`: `response.created`, `response.in_progress`, "
    "per output item `response.output_item.added`, its parts and deltas, "
    "`response.output_item.done`; then `response.completed` or `response.incomplete`. No "
    "`[DONE]`; an error after the first event is one `error` event."
)


def _responses() -> dict[int | str, dict[str, Any]]:
    ok = {"model": ResponseObject, "description": "A response." + _STREAM_NOTE}
    return {200: ok, **error_responses(GENERATION_ERRORS)}


@router.post("/v1/responses", response_model=None, responses=_responses())
async def create_response(body: ResponsesBody, request: Request) -> Response:
    """Create a model response; the frontend serves it on the chat path."""
    client: FrontendClient = request.state.frontend
    rid: str = request.state.request_id
    check_extra_fields(body)
    proto = responses_request_to_proto(body, rid)
    options = client.options(rid)
    return await respond(
        request,
        stream=body.stream,
        start_stream=partial(client.stub.ResponsesCreateStream, proto, **options),
        start_unary=partial(client.stub.ResponsesCreate, proto, **options),
        framer=ResponseFrames(),
        render_whole=response_to_dict,
    )


@router.get(
    "/v1/responses/{response_id}",
    response_model=None,
    responses=responses(ResponseObject, "The stored response.", (404, *READ_ERRORS)),
)
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    """A response stored by this frontend; 404 naming the id when unknown or expired."""
    client: FrontendClient = request.state.frontend
    proto = responses_pb2.ResponsesGetRequest(response_id=response_id)
    call = client.stub.ResponsesGet(proto, **client.options(request.state.request_id))
    return response_to_dict(await until_disconnected(request, call, call))
