"""OpenAI's Responses API: create, retrieve (or stream a background response again), list
input items, delete and cancel, each onto its frontend RPC (ResponsesCreate[Stream],
ResponsesGet[Stream], ResponsesInputItems, ResponsesDelete, ResponsesCancel)."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from tokenline.v1 import responses_pb2

from gateway.client import FrontendClient, until_disconnected
from gateway.errors import GatewayError
from gateway.extra_fields import check_extra_fields
from gateway.openapi import GENERATION_ERRORS, READ_ERRORS, error_responses, responses
from gateway.responses_api.bodies import (
    ResponseDeletedObject,
    ResponseItemListObject,
    ResponseObject,
)
from gateway.responses_api.convert import responses_request_to_proto
from gateway.responses_api.render import ResponseFrames, item_list_to_dict, response_to_dict
from gateway.responses_api.schemas import ResponsesBody
from gateway.sse import respond, stream_response

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


_REPLAY_NOTE = (
    " With `stream=true` (a `background` response only): its events as the create's stream "
    "sent them, those after `starting_after` (all without it), then live until its last."
)


@router.get(
    "/v1/responses/{response_id}",
    response_model=None,
    responses=responses(
        ResponseObject, "The stored response." + _REPLAY_NOTE, (400, 404, *READ_ERRORS)
    ),
)
async def retrieve_response(
    response_id: str,
    request: Request,
    stream: Annotated[
        Literal["true", "false"] | None,
        Query(description="true: the events of a background response"),
    ] = None,
    starting_after: Annotated[
        int | None,
        Query(ge=0, lt=2**31, description="with stream: replay the events after this number"),
    ] = None,
    include_obfuscation: Annotated[
        Literal["false"] | None,
        Query(description="false only: this server writes no obfuscation padding"),
    ] = None,
) -> Response | dict[str, Any]:
    """A response stored by this frontend; 404 naming the id when unknown or expired. With
    ``stream=true``, a background response's events again (ResponsesGetStream). A bad
    parameter is the validation's 400 naming it, as every typed query parameter's."""
    _check_query(request, {"stream", "starting_after", "include_obfuscation"})
    client: FrontendClient = request.state.frontend
    options = client.options(request.state.request_id)
    if stream == "true":
        replay = responses_pb2.ResponsesGetStreamRequest(
            response_id=response_id, starting_after=starting_after
        )
        keepalive_s = request.state.config.sse_keepalive_s
        call = client.stub.ResponsesGetStream(replay, **options)
        return await stream_response(request, call, ResponseFrames(), keepalive_s)
    if starting_after is not None:
        raise GatewayError(400, "starting_after: only with stream=true", param="starting_after")
    proto = responses_pb2.ResponsesGetRequest(response_id=response_id)
    call = client.stub.ResponsesGet(proto, **options)
    return response_to_dict(await until_disconnected(request, call, call))


@router.get(
    "/v1/responses/{response_id}/input_items",
    response_model=None,
    responses=responses(
        ResponseItemListObject, "A page of the response's input items.", (400, 404, *READ_ERRORS)
    ),
)
async def list_input_items(
    response_id: str,
    request: Request,
    limit: Annotated[int | None, Query(description="1 to 100; default 20")] = None,
    order: Annotated[
        str | None, Query(description='"asc" | "desc" (the default: newest first)')
    ] = None,
    after: Annotated[str | None, Query(description="an item id: list the items after it")] = None,
) -> dict[str, Any]:
    """The input items of a stored response: the conversation it continued and its own
    input, without its instructions; 404 naming the id as GET. Any other parameter
    (``include``: this server has no includable fields) is a 400 naming it."""
    _check_query(request, {"limit", "order", "after"})
    client: FrontendClient = request.state.frontend
    proto = responses_pb2.ResponsesInputItemsRequest(
        response_id=response_id, order=order or "", after=after or ""
    )
    if limit is not None:
        try:
            proto.limit = limit
        except ValueError:
            raise GatewayError(
                400, f"limit: must be between 1 and 100, got {limit}", param="limit"
            ) from None
    call = client.stub.ResponsesInputItems(proto, **client.options(request.state.request_id))
    return item_list_to_dict(await until_disconnected(request, call, call))


def _check_query(request: Request, known: set[str]) -> None:
    for key in request.query_params:
        name = key.removesuffix("[]")  # the openai SDK writes lists as include[]=...
        if name not in known:
            raise GatewayError(
                400,
                f"{name}: not supported on this route",
                param=name,
                code="unsupported_field",
            )


@router.delete(
    "/v1/responses/{response_id}",
    response_model=None,
    responses=responses(ResponseDeletedObject, "Deleted.", (404, *READ_ERRORS)),
)
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    """Forget a stored response (a background one still running is cancelled); 404 naming
    the id as GET."""
    client: FrontendClient = request.state.frontend
    proto = responses_pb2.ResponsesDeleteRequest(response_id=response_id)
    call = client.stub.ResponsesDelete(proto, **client.options(request.state.request_id))
    deleted = await until_disconnected(request, call, call)
    return {"id": deleted.id, "object": "response", "deleted": deleted.deleted}


@router.post(
    "/v1/responses/{response_id}/cancel",
    response_model=None,
    responses=responses(ResponseObject, "The response, `cancelled`.", (400, 404, *READ_ERRORS)),
)
async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    """Cancel a `background` response while it runs (its request is aborted); any other
    response is a 400, as OpenAI's: "Cannot cancel a synchronous response."."""
    client: FrontendClient = request.state.frontend
    proto = responses_pb2.ResponsesCancelRequest(response_id=response_id)
    call = client.stub.ResponsesCancel(proto, **client.options(request.state.request_id))
    return response_to_dict(await until_disconnected(request, call, call))
