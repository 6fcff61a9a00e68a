"""The operator's RPCs: model and server info, prefix-cache flush, abort by client id.

Each fans out over the services this frontend knows (its scheduler replicas and the
detokenizer) through their own RPCs, and reports what each answered; a replica that
does not answer is reported, not hidden.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable
from typing import TypeVar

import grpc
from tokenline.v1 import common_pb2, frontend_pb2, scheduler_pb2

from services.common.auth.caller import may_touch, require_admin
from services.common.deadlines import ENGINE_ANSWER_RPC_TIMEOUT_S
from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.version import package_version
from services.frontend.dispatch.request_state import ReqState
from services.frontend.serving.base import ServingContext

logger = logging.getLogger(__name__)

T = TypeVar("T")
INFO_TIMEOUT_S = 5.0
# What a batch or n > 1 request adds to the client's id: <id>-<j> and <id>-<j>-<i>.
_ELEMENT_SUFFIX = re.compile(r"(-\d+){1,2}")


def is_label_of(label: str, client_id: str) -> bool:
    """Whether a choice labelled ``label`` belongs to the request the client called
    ``client_id``: the label itself, or one of its batch elements / choices."""
    if label == client_id:
        return True
    return label.startswith(client_id) and bool(_ELEMENT_SUFFIX.fullmatch(label[len(client_id) :]))


async def _answer(call: Awaitable[T]) -> tuple[T | None, str]:
    """(reply, "") or (None, why): one service's silence must not hide the others."""
    try:
        return await call, ""
    except grpc.aio.AioRpcError as exc:
        return None, f"{exc.code().name}: {exc.details()}"


class Operations:
    def __init__(self, ctx: ServingContext, *, model_path: str, metrics_port: int) -> None:
        self.ctx = ctx
        self.manager = ctx.manager
        self.model_path = model_path
        self.metrics_port = metrics_port

    def frontend_info(self) -> frontend_pb2.FrontendInfo:
        manager, batcher = self.manager, self.ctx.batcher
        return frontend_pb2.FrontendInfo(
            num_live_requests=len(manager.table),
            frontend_id=manager.frontend_id,
            num_tokenizer_calls=batcher.num_calls,
            num_tokenized_requests=batcher.num_requests,
            num_aborts_sent=manager.num_aborts_sent,
            metrics_port=self.metrics_port,
            default_sampling=self._default_sampling(),
        )

    def _default_sampling(self) -> common_pb2.SamplingParams:
        pb = self.ctx.sampling_defaults.to_pb()
        pb.max_new_tokens = self.ctx.limits.default_max_tokens
        return pb

    def model_info(self) -> frontend_pb2.ModelInfo:
        """The served model as this frontend sees it; dtype and context length come from
        the schedulers' lease beats (empty / 0 while none is leased)."""
        return frontend_pb2.ModelInfo(
            model_path=self.model_path,
            tokenizer_path=self.model_path,  # the tokenizer is loaded from the model folder
            served_model_name=self.ctx.model_name,
            is_generation=not self.manager.router.runs_pooling_only(),
            dtype=self.manager.router.served_dtype(),
            architecture=self.manager.router.served_architecture(),
            model_impl=self.manager.router.served_model_impl(),
            max_model_len=self.ctx.current_limits().context_length,
            vocab_size=self.ctx.limits.vocab_size,
        )

    async def server_info(self) -> frontend_pb2.ServerInfo:
        """Every service's own GetInfo, asked concurrently."""
        stubs = self.manager.schedulers
        request = scheduler_pb2.ServerInfoRequest()
        answers = await asyncio.gather(
            *(_answer(s.GetInfo(request, timeout=INFO_TIMEOUT_S)) for s in stubs.values()),
            _answer(self.manager.detokenizer_info()),
        )
        info = frontend_pb2.ServerInfo(
            version=package_version(), model=self.model_info(), frontend=self.frontend_info()
        )
        for addr, (reply, error) in zip(stubs, answers[:-1], strict=True):
            replica = info.schedulers.add(
                address=addr, is_leased=self.manager.router.is_leased(addr), error=error
            )
            if reply is not None:
                replica.info.CopyFrom(reply)
        detok, error = answers[-1]
        info.detokenizer.address = self.manager.detokenizer_addr
        info.detokenizer.error = error
        if detok is not None:
            info.detokenizer.info.CopyFrom(detok)
        return info

    async def flush_cache(self) -> frontend_pb2.FlushCacheResponse:
        """Ask every replica to flush; each refuses on its own while it has requests in
        flight. UNAVAILABLE when one did not answer (the others may have flushed)."""
        stubs = self.manager.schedulers
        request = scheduler_pb2.FlushCacheRequest()
        timeout = ENGINE_ANSWER_RPC_TIMEOUT_S
        answers = await asyncio.gather(
            *(_answer(s.FlushCache(request, timeout=timeout)) for s in stubs.values())
        )
        response = frontend_pb2.FlushCacheResponse()
        for addr, (result, error) in zip(stubs, answers, strict=True):
            if result is None:
                raise UnavailableError(f"scheduler {addr} did not flush: {error}")
            response.schedulers.add(address=addr, result=result)
        response.success = all(s.result.flushed for s in response.schedulers)
        logger.info("flush_cache: %s", "flushed" if response.success else "refused (busy)")
        return response

    async def abort(self, request: frontend_pb2.AbortRequest) -> frontend_pb2.AbortResponse:
        """Abort the live requests ``rid`` names (a client id or a frontend-made rid), or
        all of this frontend's with ``abort_all``; none found is not an error (SGLang).
        ``abort_all`` needs an admin key; a user's abort reaches only their own requests."""
        if not request.abort_all and not request.rid:
            raise InvalidArgumentError("give a rid, or abort_all: true", field="rid")
        if request.abort_all:
            require_admin("abort_all")
        live = self.manager.table.live()
        states = [s for s in live if may_touch(s.owner) and self._selects(request, s)]
        reason = "aborted by /abort_request"
        num_aborted = await self.manager.abort_live(states, reason)
        logger.info("abort_request: %d of %d live requests", num_aborted, len(states))
        return frontend_pb2.AbortResponse(num_aborted=num_aborted)

    @staticmethod
    def _selects(request: frontend_pb2.AbortRequest, state: ReqState) -> bool:
        return (
            request.abort_all or state.rid == request.rid or is_label_of(state.label, request.rid)
        )
