"""SGLang's sessions: /open_session and /close_session, one frontend RPC each.

/open_session answers the session id as a bare JSON string, as SGLang does; requests
then name it in /generate's ``session_params`` (docs/api.md, "Sessions"). The frontend
routes a session to the scheduler replica that holds it; the gateway only shapes JSON.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import RootModel
from tokenline.v1 import session_pb2

from gateway.client import FrontendClient, until_disconnected
from gateway.extra_fields import check_extra_fields
from gateway.openapi import BODY_ERRORS, error_responses, responses
from gateway.schemas import CloseSessionBody, OpenSessionBody

router = APIRouter()


class SessionIdResponse(RootModel[str]):
    """The session id, a JSON string."""


@router.post(
    "/open_session",
    tags=["native"],
    response_model=None,
    responses=responses(SessionIdResponse, "The session id (a JSON string).", (409, *BODY_ERRORS)),
)
async def open_session(body: OpenSessionBody, request: Request) -> Response:
    """Open a session on one scheduler replica; 409 when `session_id` is already open."""
    check_extra_fields(body)
    client: FrontendClient = request.state.frontend
    proto = session_pb2.OpenSessionReqInput(
        capacity_of_str_len=body.capacity_of_str_len, session_id=body.session_id or ""
    )
    call = client.stub.OpenSession(proto, **client.options(request.state.request_id))
    reply = await until_disconnected(request, call, call)
    return JSONResponse(reply.session_id)


@router.post(
    "/close_session",
    tags=["native"],
    response_model=None,
    responses={200: {"description": "Closed (empty body)."}, **error_responses(BODY_ERRORS)},
)
async def close_session(body: CloseSessionBody, request: Request) -> Response:
    """Close a session: its running requests are aborted and its KV is unpinned."""
    check_extra_fields(body)
    client: FrontendClient = request.state.frontend
    proto = session_pb2.CloseSessionReqInput(session_id=body.session_id)
    call = client.stub.CloseSession(proto, **client.options(request.state.request_id))
    await until_disconnected(request, call, call)
    return Response(status_code=200)
