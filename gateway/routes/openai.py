"""OpenAI-compatible routes: each converts JSON → proto, makes one call, renders back."""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response
from tokenline.v1 import frontend_pb2, openai_pb2

from gateway.client import FrontendClient, until_disconnected
from gateway.convert import chat_request_to_proto, completion_request_to_proto
from gateway.errors import GatewayError
from gateway.extra_fields import check_extra_fields
from gateway.openapi import GENERATION_ERRORS, READ_ERRORS, responses
from gateway.render.openai import (
    chat_chunk,
    chat_completion_to_dict,
    completion_to_dict,
    model_list_to_dict,
    model_to_dict,
    text_completion,
)
from gateway.render.text_frames import CHAT_TEXT, COMPLETION_TEXT
from gateway.responses import ChatCompletion, ChatCompletionChunk, Completion, Model, ModelList
from gateway.schemas import ChatCompletionBody, CompletionBody, SharedRequestBody
from gateway.sse import DataFrames, respond
from services.common.envs import TRUE_WORDS

router = APIRouter(tags=["openai"])
DEBUG_HEADER = "x-tokenline-debug"


def _wants_debug(request: Request) -> bool:
    """``X-Tokenline-Debug: 1`` adds each request's stage breakdown (``debug``) to the
    response, or to each choice's finish chunk when streaming."""
    return request.headers.get(DEBUG_HEADER, "").lower() in TRUE_WORDS


def _include_usage(body: SharedRequestBody) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses=responses(
        ChatCompletion, "A chat.completion.", GENERATION_ERRORS, stream_frame=ChatCompletionChunk
    ),
)
async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
    """Chat completion; `stream: true` answers with SSE `chat.completion.chunk` frames."""
    client: FrontendClient = request.state.frontend
    rid: str = request.state.request_id
    check_extra_fields(body)
    proto = chat_request_to_proto(body, rid)
    options = client.options(rid)
    debug = _wants_debug(request)
    return await respond(
        request,
        stream=body.stream,
        start_stream=client.stream_starter("chat", proto, rid),
        start_unary=partial(client.stub.ChatCompletion, proto, **options),
        framer=DataFrames(
            partial(
                chat_chunk, include_usage=_include_usage(body), logprobs=body.logprobs, debug=debug
            ),
            CHAT_TEXT,
        ),
        render_whole=partial(chat_completion_to_dict, logprobs=body.logprobs, debug=debug),
    )


@router.post(
    "/v1/completions",
    response_model=None,
    responses=responses(
        Completion, "A text_completion.", GENERATION_ERRORS, stream_frame=Completion
    ),
)
async def completions(body: CompletionBody, request: Request) -> Response:
    """Text completion; `stream: true` answers with SSE `text_completion` frames."""
    client: FrontendClient = request.state.frontend
    rid: str = request.state.request_id
    check_extra_fields(body)
    proto = completion_request_to_proto(body, rid)
    shape = {
        "include_usage": _include_usage(body),
        "logprobs": body.logprobs is not None,
        "debug": _wants_debug(request),
    }
    options = client.options(rid)
    return await respond(
        request,
        stream=body.stream,
        start_stream=client.stream_starter("completion", proto, rid),
        start_unary=partial(client.stub.Completion, proto, **options),
        framer=DataFrames(partial(text_completion, **shape), COMPLETION_TEXT),
        render_whole=partial(completion_to_dict, **shape),
    )


async def _list_models(request: Request) -> openai_pb2.ModelList:
    client: FrontendClient = request.state.frontend
    call = client.stub.ListModels(
        frontend_pb2.ListModelsRequest(), **client.options(request.state.request_id)
    )
    return await until_disconnected(request, call, call)


@router.get(
    "/v1/models", response_model=None, responses=responses(ModelList, "The list.", READ_ERRORS)
)
async def list_models(request: Request) -> dict[str, Any]:
    """The models the frontend serves."""
    return model_list_to_dict(await _list_models(request))


@router.get(
    "/v1/models/{model_id:path}",
    response_model=None,
    responses=responses(Model, "The model.", (404, *READ_ERRORS)),
)
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """One model by id (ids may contain `/`); 404 when the frontend does not serve it."""
    for model in (await _list_models(request)).data:
        if model.id == model_id:
            return model_to_dict(model)
    raise GatewayError(
        404, f"The model '{model_id}' does not exist", param="model", code="model_not_found"
    )
