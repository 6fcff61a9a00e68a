"""FrontendService: each RPC hands the request to one serving object."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, TypeVar

import grpc
from tokenline.v1 import frontend_pb2, frontend_pb2_grpc, openai_pb2, session_pb2

from services.common.auth.caller import set_caller
from services.common.errors import InvalidArgumentError, grpc_errors
from services.frontend.auth import Authenticator
from services.frontend.multiplex import StreamBudget, serve_multiplexed
from services.frontend.serving.chat import ChatServing
from services.frontend.serving.completion import CompletionServing
from services.frontend.serving.embeddings import EmbeddingServing
from services.frontend.serving.generate import GenerateServing
from services.frontend.serving.operations import Operations
from services.frontend.serving.responses import ResponsesServing

T = TypeVar("T")


async def _closing_on_done(
    context: grpc.aio.ServicerContext, stream: AsyncIterator[T]
) -> AsyncIterator[T]:
    """Yield from ``stream`` and make sure it is closed when the RPC ends.

    A client cancel can land while the handler waits on a write, outside the
    generator; grpc.aio then drops the generator without closing it. The done
    callback closes it at once, so its cleanup (abort of the running choices)
    does not wait for garbage collection.
    """
    agen: Any = stream
    tasks: set[asyncio.Task] = set()

    async def aclose_quietly() -> None:
        # RuntimeError: it is still unwinding from a cancel inside it, and closes itself.
        with contextlib.suppress(RuntimeError):
            await agen.aclose()

    def close(_: object) -> None:
        task = asyncio.get_running_loop().create_task(aclose_quietly())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    context.add_done_callback(close)
    async with aclosing(agen):
        async for item in agen:
            yield item


class FrontendServicer(frontend_pb2_grpc.FrontendServiceServicer):
    def __init__(
        self,
        chat: ChatServing,
        completion: CompletionServing,
        generate: GenerateServing,
        ops: Operations,
        streams: StreamBudget | None = None,
        auth: Authenticator | None = None,
        *,
        responses: ResponsesServing | None = None,
        embeddings: EmbeddingServing | None = None,
    ) -> None:
        self.chat = chat
        self.responses = responses if responses is not None else ResponsesServing(chat)
        self.embeddings = embeddings if embeddings is not None else EmbeddingServing(chat.ctx)
        self.completion = completion
        self.generate = generate
        self.ops = ops
        self.ctx = chat.ctx
        self.started = int(time.time())
        self.streams = streams if streams is not None else StreamBudget(None)
        self.auth = auth

    @grpc_errors
    async def ChatCompletion(self, request, context):  # noqa: N802 - gRPC method names
        return await self.chat.complete(request)

    @grpc_errors
    async def ChatCompletionStream(self, request, context):  # noqa: N802
        async for chunk in _closing_on_done(context, self.chat.stream(request)):
            yield chunk

    @grpc_errors
    async def Completion(self, request, context):  # noqa: N802
        return await self.completion.complete(request)

    @grpc_errors
    async def CompletionStream(self, request, context):  # noqa: N802
        async for chunk in _closing_on_done(context, self.completion.stream(request)):
            yield chunk

    @grpc_errors
    async def ResponsesCreate(self, request, context):  # noqa: N802
        return await self.responses.create(request)

    @grpc_errors
    async def ResponsesCreateStream(self, request, context):  # noqa: N802
        async for event in _closing_on_done(context, self.responses.stream(request)):
            yield event

    @grpc_errors
    async def ResponsesGet(self, request, context):  # noqa: N802
        return self.responses.get(request.response_id)

    @grpc_errors
    async def ResponsesGetStream(self, request, context):  # noqa: N802
        async for event in _closing_on_done(context, self.responses.replay(request)):
            yield event

    @grpc_errors
    async def ResponsesInputItems(self, request, context):  # noqa: N802
        return self.responses.input_items(request)

    @grpc_errors
    async def ResponsesDelete(self, request, context):  # noqa: N802
        return self.responses.delete(request.response_id)

    @grpc_errors
    async def ResponsesCancel(self, request, context):  # noqa: N802
        return self.responses.cancel(request.response_id)

    @grpc_errors
    async def Embed(self, request, context):  # noqa: N802
        return await self.embeddings.embed(request)

    @grpc_errors
    async def Multiplex(self, request_iterator, context):  # noqa: N802
        async for batch in serve_multiplexed(request_iterator, self._open_stream, self.streams):
            yield batch

    def _open_stream(self, request: frontend_pb2.MuxRequest) -> AsyncGenerator[Any, None]:
        """A multiplexed stream's messages: what its per-request RPC would stream, made
        for the caller the request names (runs in the stream's own task)."""
        if request.caller and self.auth is not None and self.auth.is_enabled:
            set_caller(self.auth.stream_caller(request.caller))
        if request.WhichOneof("kind") == "chat":
            return self.chat.stream(request.chat)
        return self.completion.stream(request.completion)

    @grpc_errors
    async def Generate(self, request, context):  # noqa: N802
        return await self.generate.complete(request)

    @grpc_errors
    async def GenerateStream(self, request, context):  # noqa: N802
        async for response in _closing_on_done(context, self.generate.stream(request)):
            yield response

    @grpc_errors
    async def Tokenize(self, request, context):  # noqa: N802
        if not request.HasField("chat"):
            tokens = await self.ctx.batcher.encode(request.prompt, request.add_special_tokens)
        elif request.add_special_tokens:
            raise InvalidArgumentError(
                "the chat template writes its own special tokens", field="add_special_tokens"
            )
        else:
            tokens = await self.chat.prompt_ids(request.chat)
        reply = frontend_pb2.TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=self.ctx.current_limits().context_length
        )
        if request.return_token_strs:
            reply.token_strs.extend(self.ctx.tokenizer.convert_ids_to_tokens(tokens))
        return reply

    @grpc_errors
    async def Detokenize(self, request, context):  # noqa: N802
        vocab = self.ctx.limits.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(f"token ids outside [0, {vocab}): {bad[:5]}", field="tokens")
        return frontend_pb2.DetokenizeResponse(prompt=self.ctx.tokenizer.decode(request.tokens))

    @grpc_errors
    async def ListModels(self, request, context):  # noqa: N802
        model = openai_pb2.Model(
            id=self.ctx.model_name,
            object="model",
            created=self.started,
            owned_by="tokenline",
            max_model_len=self.ctx.current_limits().context_length,
            dtype=self.ctx.manager.router.served_dtype(),
            architecture=self.ctx.manager.router.served_architecture(),
            model_impl=self.ctx.manager.router.served_model_impl(),
        )
        return openai_pb2.ModelList(object="list", data=[model])

    @grpc_errors
    async def OpenSession(self, request, context):  # noqa: N802
        sessions = self.ctx.manager.sessions
        session_id = await sessions.open(request.session_id, request.capacity_of_str_len)
        return session_pb2.OpenSessionReqOutput(session_id=session_id)

    @grpc_errors
    async def CloseSession(self, request, context):  # noqa: N802
        await self.ctx.manager.sessions.close(request.session_id)
        return session_pb2.CloseSessionReqOutput()

    @grpc_errors
    async def GetInfo(self, request, context):  # noqa: N802
        return self.ops.frontend_info()

    @grpc_errors
    async def GetModelInfo(self, request, context):  # noqa: N802
        return self.ops.model_info()

    @grpc_errors
    async def GetServerInfo(self, request, context):  # noqa: N802
        return await self.ops.server_info()

    @grpc_errors
    async def FlushCache(self, request, context):  # noqa: N802
        return await self.ops.flush_cache()

    @grpc_errors
    async def Abort(self, request, context):  # noqa: N802
        return await self.ops.abort(request)
