"""Native routes: /generate (SGLang's JSON), tokenize, health (shallow and deep), metrics.

The other operator routes (version, model and server info, flush, abort) are in
gateway/routes/ops.py."""

from __future__ import annotations

from functools import partial
from typing import Any

import grpc
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from tokenline.v1 import common_pb2, generate_pb2

from gateway.client import FrontendClient, until_disconnected
from gateway.convert import (
    detokenize_request_to_proto,
    generate_request_to_proto,
    tokenize_request_to_proto,
)
from gateway.errors import error_body
from gateway.extra_fields import check_extra_fields
from gateway.metrics import GatewayMetrics
from gateway.openapi import BODY_ERRORS, GENERATION_ERRORS, error_responses, responses
from gateway.render.generate import GenerateRenderer, GenerateView
from gateway.responses import (
    DetokenizeResponse,
    GenerateOutput,
    GenerateResponse,
    HealthResponse,
    TokenizeResponse,
)
from gateway.schemas import DetokenizeBody, GenerateBody, TokenizeBody
from gateway.sse import DataFrames, respond

router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 10.0


@router.post(
    "/generate",
    response_model=None,
    tags=["native"],
    responses=responses(
        GenerateResponse,
        "SGLang's shape: one object for a single prompt, a list for a batch or n > 1.",
        GENERATION_ERRORS,
        stream_frame=GenerateOutput,
    ),
)
async def generate(body: GenerateBody, request: Request) -> Response:
    """`GenerateReqInput` in (SGLang's JSON or proto JSON), SGLang's JSON out; SSE frames
    with the output so far when streaming."""
    client: FrontendClient = request.state.frontend
    check_extra_fields(body)
    proto = generate_request_to_proto(body, request.state.request_id)
    renderer = GenerateRenderer(GenerateView.of(body, proto))
    options = client.options(request.state.request_id)
    return await respond(
        request,
        stream=proto.stream,
        start_stream=partial(client.stub.GenerateStream, proto, **options),
        start_unary=partial(client.stub.Generate, proto, **options),
        framer=DataFrames(renderer.frame),
        render_whole=renderer.whole,
    )


@router.post(
    "/tokenize",
    response_model=None,
    tags=["native"],
    responses=responses(TokenizeResponse, "The token ids.", BODY_ERRORS),
)
@router.post(
    "/v1/tokenize",
    response_model=None,
    tags=["native"],
    responses=responses(TokenizeResponse, "The token ids.", BODY_ERRORS),
)
async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
    """vLLM's tokenize: token ids of `prompt`, or of chat `messages` templated as a chat
    request would be."""
    check_extra_fields(body)
    client: FrontendClient = request.state.frontend
    proto = tokenize_request_to_proto(body, request.state.request_id)
    call = client.stub.Tokenize(proto, **client.options(request.state.request_id))
    reply = await until_disconnected(request, call, call)
    fields = {"token_strs": list(reply.token_strs)} if body.return_token_strs else {}
    return TokenizeResponse(
        tokens=list(reply.tokens), count=reply.count, max_model_len=reply.max_model_len, **fields
    ).dump()


@router.post(
    "/detokenize",
    response_model=None,
    tags=["native"],
    responses=responses(DetokenizeResponse, "The text.", BODY_ERRORS),
)
@router.post(
    "/v1/detokenize",
    response_model=None,
    tags=["native"],
    responses=responses(DetokenizeResponse, "The text.", BODY_ERRORS),
)
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
    """Text of `tokens` with the served model's tokenizer."""
    check_extra_fields(body)
    client: FrontendClient = request.state.frontend
    proto = detokenize_request_to_proto(body)
    call = client.stub.Detokenize(proto, **client.options(request.state.request_id))
    reply = await until_disconnected(request, call, call)
    return DetokenizeResponse(prompt=reply.prompt).dump()


@router.get(
    "/health",
    tags=["ops"],
    response_model=None,
    responses={200: {"model": HealthResponse, "description": "Ready"}, **error_responses((503,))},
)
@router.get(
    "/ping",
    operation_id="ping_get",
    tags=["ops"],
    response_model=None,
    responses={200: {"model": HealthResponse, "description": "Ready"}, **error_responses((503,))},
)
@router.post(
    "/ping",
    operation_id="ping_post",
    tags=["ops"],
    response_model=None,
    responses={200: {"model": HealthResponse, "description": "Ready"}, **error_responses((503,))},
)
async def health(request: Request) -> Response:
    """200 when the frontend's gRPC readiness check says SERVING, else 503. Also served
    as vLLM's (SageMaker's) `/ping`, GET or POST."""
    client: FrontendClient = request.state.frontend
    if await client.is_ready():
        return JSONResponse(HealthResponse(status="ok").dump())
    return JSONResponse(
        error_body(503, "frontend is not ready", code="unavailable"), status_code=503
    )


@router.get(
    "/health_generate",
    tags=["ops"],
    response_model=None,
    responses={
        200: {"model": HealthResponse, "description": "One token came back"},
        **error_responses((503,)),
    },
)
async def health_generate(request: Request) -> Response:
    """SGLang's deep check: one greedy token through frontend, scheduler and detokenizer.

    200 when it comes back within the deadline, else 503 naming what failed."""
    client: FrontendClient = request.state.frontend
    proto = generate_pb2.GenerateReqInput(
        text=["ping"],
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=1),
    )
    options = client.options(request.state.request_id) | {"timeout": HEALTH_GENERATE_TIMEOUT_S}
    call = client.stub.Generate(proto, **options)
    try:
        await until_disconnected(request, call, call)
    except grpc.aio.AioRpcError as exc:
        message = f"one-token generation failed: {exc.code().name}"
        return JSONResponse(error_body(503, message, code="unavailable"), status_code=503)
    return JSONResponse(HealthResponse(status="ok").dump())


@router.get(
    "/metrics",
    tags=["ops"],
    response_model=None,
    response_class=PlainTextResponse,
)
async def metrics(request: Request) -> Response:
    """Prometheus exposition of the gateway's own request metrics."""
    gateway_metrics: GatewayMetrics = request.state.metrics
    return Response(gateway_metrics.exposition(), media_type=gateway_metrics.content_type)
