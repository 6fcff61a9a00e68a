"""FrontendService: each RPC hands the request to one serving object."""

from __future__ import annotations

import time

from tokenline.v1 import frontend_pb2, frontend_pb2_grpc, openai_pb2

from services.common.errors import InvalidArgumentError, grpc_errors
from services.frontend.serving_chat import ChatServing
from services.frontend.serving_completion import CompletionServing
from services.frontend.serving_generate import GenerateServing


class FrontendServicer(frontend_pb2_grpc.FrontendServiceServicer):
    def __init__(
        self, chat: ChatServing, completion: CompletionServing, generate: GenerateServing
    ) -> None:
        self.chat = chat
        self.completion = completion
        self.generate = generate
        self.started = int(time.time())

    @grpc_errors
    async def ChatCompletion(self, request, context):  # noqa: N802 - gRPC method names
        return await self.chat.complete(request)

    @grpc_errors
    async def ChatCompletionStream(self, request, context):  # noqa: N802
        async for chunk in self.chat.stream(request):
            yield chunk

    @grpc_errors
    async def Completion(self, request, context):  # noqa: N802
        return await self.completion.complete(request)

    @grpc_errors
    async def CompletionStream(self, request, context):  # noqa: N802
        async for chunk in self.completion.stream(request):
            yield chunk

    @grpc_errors
    async def Generate(self, request, context):  # noqa: N802
        return await self.generate.complete(request)

    @grpc_errors
    async def GenerateStream(self, request, context):  # noqa: N802
        async for response in self.generate.stream(request):
            yield response

    @grpc_errors
    async def Tokenize(self, request, context):  # noqa: N802
        tokens = self.chat.tokenizer.encode(
            request.prompt, add_special_tokens=request.add_special_tokens
        )
        return frontend_pb2.TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=self.chat.limits.context_length
        )

    @grpc_errors
    async def Detokenize(self, request, context):  # noqa: N802
        vocab = self.chat.limits.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(f"token ids outside [0, {vocab}): {bad[:5]}", field="tokens")
        return frontend_pb2.DetokenizeResponse(prompt=self.chat.tokenizer.decode(request.tokens))

    @grpc_errors
    async def ListModels(self, request, context):  # noqa: N802
        model = openai_pb2.Model(
            id=self.chat.model_name,
            object="model",
            created=self.started,
            owned_by="tokenline",
            max_model_len=self.chat.limits.context_length,
        )
        return openai_pb2.ModelList(object="list", data=[model])

    @grpc_errors
    async def GetInfo(self, request, context):  # noqa: N802
        return frontend_pb2.FrontendInfo(
            num_live_requests=len(self.chat.manager.table),
            frontend_id=self.chat.manager.frontend_id,
        )
