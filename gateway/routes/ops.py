"""Operator routes in SGLang's and vLLM's names: version, model and server info, flushing
the prefix cache, aborting requests by the id the client knows.

Each is one frontend RPC (the frontend fans out to its schedulers and the detokenizer);
the gateway only shapes the JSON, through the models in gateway/responses.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tokenline.v1 import frontend_pb2, frontend_pb2_grpc, scheduler_pb2

from gateway import responses as out
from gateway.client import FrontendClient, until_disconnected
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.extra_fields import check_extra_fields
from gateway.openapi import BODY_ERRORS, READ_ERRORS, responses
from gateway.schemas import AbortBody
from services.common.version import package_version

router = APIRouter()


def _stub(request: Request) -> frontend_pb2_grpc.FrontendServiceStub:
    client: FrontendClient = request.state.frontend
    return client.stub


async def _call(request: Request, rpc: Callable[..., Any], message: Message) -> Any:
    """One unary frontend RPC for this HTTP request, cancelled if the client leaves."""
    client: FrontendClient = request.state.frontend
    call = rpc(message, **client.options(request.state.request_id))
    return await until_disconnected(request, call, call)


@router.get(
    "/version",
    tags=["ops"],
    response_model=None,
    responses={200: {"model": out.VersionResponse, "description": "The package version"}},
)
async def version() -> dict[str, Any]:
    """vLLM's /version: the tokenline package this gateway runs."""
    return out.VersionResponse(version=package_version()).dump()


def _model_info(info: frontend_pb2.ModelInfo) -> out.ModelInfoResponse:
    return out.ModelInfoResponse(
        model_path=info.model_path,
        tokenizer_path=info.tokenizer_path,
        is_generation=info.is_generation,
        served_model_name=info.served_model_name,
        dtype=info.dtype,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        architecture=info.architecture,
        model_impl=info.model_impl,
    )


@router.get(
    "/get_model_info",
    tags=["ops"],
    response_model=None,
    responses=responses(out.ModelInfoResponse, "The served model.", READ_ERRORS),
)
async def get_model_info(request: Request) -> dict[str, Any]:
    """SGLang's model info, as the frontend and its leased schedulers report it."""
    reply = await _call(request, _stub(request).GetModelInfo, frontend_pb2.ModelInfoRequest())
    return _model_info(reply).dump()


_INT64 = frozenset({FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64})


def _as_json(message: Message) -> dict[str, Any]:
    """A GetInfo reply as JSON, its 64-bit counters as numbers (proto3 JSON would print
    them as strings): this is an operator's view, read by scripts."""
    data = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for field in message.DESCRIPTOR.fields:
        if field.cpp_type in _INT64 and isinstance(data.get(field.name), str):
            data[field.name] = int(data[field.name])
    return data


def _service(address: str, info: Message | None, error: str = "") -> out.ServiceInfo:
    """A service's entry; its scrape target is its own host with its metrics port."""
    port = getattr(info, "metrics_port", 0) if info is not None else 0
    host = address.rsplit(":", 1)[0]
    fields: dict[str, Any] = {"error": error} if error else {}
    return out.ServiceInfo(
        address=address,
        metrics=f"{host}:{port}" if port else None,
        info=_as_json(info) if info is not None else None,
        **fields,
    )


def _server_info(info: frontend_pb2.ServerInfo, config: GatewayConfig) -> out.ServerInfoResponse:
    gateway = f"{config.host}:{config.port}"
    schedulers = []
    for replica in info.schedulers:
        entry = _service(
            replica.address, replica.info if replica.HasField("info") else None, replica.error
        )
        entry.is_leased = replica.is_leased
        schedulers.append(entry)
    detok = info.detokenizer
    return out.ServerInfoResponse(
        version=info.version,
        model=_model_info(info.model),
        gateway=out.ServiceInfo(address=gateway, metrics=gateway, info=None),
        frontend=_service(config.frontend_addr, info.frontend),
        schedulers=schedulers,
        detokenizer=_service(
            detok.address, detok.info if detok.HasField("info") else None, detok.error
        ),
    )


@router.get(
    "/get_server_info",
    tags=["ops"],
    response_model=None,
    responses=responses(out.ServerInfoResponse, "Every service's own view.", READ_ERRORS),
)
async def get_server_info(request: Request) -> dict[str, Any]:
    """SGLang's server info: each service's GetInfo and its Prometheus scrape target."""
    reply = await _call(request, _stub(request).GetServerInfo, frontend_pb2.GetServerInfoRequest())
    return _server_info(reply, request.state.config).dump()


_FLUSHED = responses(out.FlushCacheResponse, "Every scheduler flushed.", BODY_ERRORS)


@router.get("/flush_cache", operation_id="flush_cache_get", tags=["ops"], responses=_FLUSHED)
@router.post("/flush_cache", operation_id="flush_cache_post", tags=["ops"], responses=_FLUSHED)
async def flush_cache(request: Request) -> JSONResponse:
    """SGLang's flush: every scheduler empties its prefix cache. A scheduler with a request
    running or waiting refuses (as SGLang's does), and then the answer is 400."""
    reply = await _call(request, _stub(request).FlushCache, scheduler_pb2.FlushCacheRequest())
    if not reply.success:
        busy = [s for s in reply.schedulers if not s.result.flushed]
        detail = "; ".join(f"{s.address}: {s.result.reason}" for s in busy)
        in_flight = any(s.result.num_running or s.result.num_waiting for s in busy)
        code = "requests_in_flight" if in_flight else "cache_pinned"
        raise GatewayError(400, f"cache not flushed ({detail})", code=code)
    body = out.FlushCacheResponse(
        success=True,
        schedulers=[
            out.SchedulerFlushResponse(
                address=s.address,
                flushed=s.result.flushed,
                num_running=s.result.num_running,
                num_waiting=s.result.num_waiting,
            )
            for s in reply.schedulers
        ],
    )
    return JSONResponse(body.dump())


@router.post(
    "/abort_request",
    tags=["ops"],
    response_model=None,
    responses=responses(out.AbortResponse, "Aborts sent.", BODY_ERRORS),
)
async def abort_request(body: AbortBody, request: Request) -> dict[str, Any]:
    """SGLang's abort: every live request the client id `rid` names (or the one whose rid
    it is), or all of this frontend's with `abort_all`. Each ends with finish reason
    `abort`; a stream's last frame says so."""
    check_extra_fields(body)
    proto = frontend_pb2.AbortRequest(rid=body.rid, abort_all=body.abort_all)
    reply = await _call(request, _stub(request).Abort, proto)
    return out.AbortResponse(num_aborted=reply.num_aborted).dump()
