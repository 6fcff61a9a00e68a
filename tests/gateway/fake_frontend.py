"""A FAKE FrontendService for gateway unit tests: canned protos, scripted failures.

It is a real grpc.aio server on a loopback port, running on its own event loop in
a background thread, so sync and async tests (and the gateway under test, in its
own thread) all reach it over the network exactly as they would the real frontend.
Nothing here tokenizes or generates; it only records what it was sent.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tokenline.v1 import (
    common_pb2,
    frontend_pb2,
    frontend_pb2_grpc,
    generate_pb2,
    openai_pb2,
    responses_pb2,
)

from services.common.errors import InvalidArgumentError, TokenlineError
from services.common.rpc.server import READINESS_SERVICE
from services.frontend.multiplex import StreamBudget, serve_multiplexed

MODEL_ID = "fake-model"
FAKE_VOCAB = 0x110000  # the fake tokenizes into Unicode code points
CREATED = 1_700_000_000
PIECES = ("Hello", " world")  # each choice's text, one streamed delta per piece
USAGE = openai_pb2.CompletionUsage(
    prompt_tokens=5,
    completion_tokens=2,
    total_tokens=7,
    prompt_tokens_details=openai_pb2.PromptTokensDetails(cached_tokens=1),
)


@dataclass
class Script:
    """What the next RPCs should do; the servicer reads it, tests set it."""

    fail_code: grpc.StatusCode | None = None
    fail_message: str = ""
    fail_field: str | None = None  # named in the rich status, as the real frontend does
    fail_after: int = 0  # streams: messages sent before failing (0: fail at once)
    hang_after: int | None = None  # streams: messages sent before waiting forever
    delay_s: float = 0.0  # unary: sleep before answering
    models: tuple[str, ...] = (MODEL_ID,)


@dataclass
class Observed:
    """What the servicer saw; written on the fake's loop, read by tests."""

    requests: list[tuple[str, Any]] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    multiplex_calls: int = 0  # Multiplex calls opened (each carries many streams)

    def last(self, method: str) -> Any:
        matches = [req for name, req in self.requests if name == method]
        assert matches, f"fake frontend never received {method}"
        return matches[-1]


def _logprobs(token: str) -> openai_pb2.ChoiceLogprobs:
    top = [openai_pb2.TopLogprobEntry(token=token, logprob=-0.5)]
    entry = openai_pb2.LogprobEntry(token=token, logprob=-0.5, top_logprobs=top)
    return openai_pb2.ChoiceLogprobs(content=[entry])


def _num_choices(sampling: openai_pb2.OpenAISampling) -> int:
    return sampling.n if sampling.HasField("n") else 1


# Stamps a real request would carry (unix seconds), 10 ms of prefill among them.
TIMES = common_pb2.StageTimes(
    received=100.0, templated=100.001, tokenized=100.002, dispatched=100.002, queued=100.003,
    scheduled=100.004, first_token=100.014, finished=100.020, detokenized=100.021,
)  # fmt: skip


def chat_completion(req: openai_pb2.ChatCompletionRequest) -> openai_pb2.ChatCompletion:
    choices = [
        openai_pb2.ChatChoice(
            index=i,
            message=openai_pb2.ChatResponseMessage(role="assistant", content="".join(PIECES)),
            logprobs=_logprobs(PIECES[0]) if req.logprobs else None,
            finish_reason="stop",
            matched_str="\n" if req.sampling.stop else None,
        )
        for i in range(_num_choices(req.sampling))
    ]
    return openai_pb2.ChatCompletion(
        id="chatcmpl-fake", object="chat.completion", created=CREATED, model=MODEL_ID,
        choices=choices, usage=USAGE, times=TIMES,
    )  # fmt: skip


def chat_chunks(req: openai_pb2.ChatCompletionRequest) -> list[openai_pb2.ChatCompletionChunk]:
    """Role chunk, one delta per piece, a finish chunk per choice, then usage if asked."""

    def chunk(**choice: Any) -> openai_pb2.ChatCompletionChunk:
        return openai_pb2.ChatCompletionChunk(
            id="chatcmpl-fake", object="chat.completion.chunk", created=CREATED, model=MODEL_ID,
            choices=[openai_pb2.ChatChunkChoice(**choice)],
        )  # fmt: skip

    n = _num_choices(req.sampling)
    out = [
        chunk(index=i, delta=openai_pb2.ChatDelta(role="assistant", content="")) for i in range(n)
    ]
    for piece in PIECES:
        for i in range(n):
            lp = _logprobs(piece) if req.logprobs else None
            out.append(chunk(index=i, delta=openai_pb2.ChatDelta(content=piece), logprobs=lp))
    for i in range(n):
        out.append(chunk(index=i, delta=openai_pb2.ChatDelta(), finish_reason="stop"))
        out[-1].times.CopyFrom(TIMES)
    if req.stream_options.include_usage:
        out.append(openai_pb2.ChatCompletionChunk(
            id="chatcmpl-fake", object="chat.completion.chunk", created=CREATED, model=MODEL_ID,
            usage=USAGE,
        ))  # fmt: skip
    return out


def _completion_choice(index: int, text: str, finish: str | None) -> openai_pb2.CompletionChoice:
    return openai_pb2.CompletionChoice(index=index, text=text, finish_reason=finish)


def completion(req: openai_pb2.CompletionRequest) -> openai_pb2.Completion:
    n = _num_choices(req.sampling) * max(len(req.prompts), len(req.prompt_token_ids), 1)
    choices = [_completion_choice(i, "".join(PIECES), "length") for i in range(n)]
    return openai_pb2.Completion(
        id="cmpl-fake", object="text_completion", created=CREATED, model=MODEL_ID,
        choices=choices, usage=USAGE,
    )  # fmt: skip


def completion_chunks(req: openai_pb2.CompletionRequest) -> list[openai_pb2.CompletionChunk]:
    def chunk(choices: list[openai_pb2.CompletionChoice], **kw: Any) -> openai_pb2.CompletionChunk:
        return openai_pb2.CompletionChunk(
            id="cmpl-fake", object="text_completion", created=CREATED, model=MODEL_ID,
            choices=choices, **kw,
        )  # fmt: skip

    out = [chunk([_completion_choice(0, piece, None)]) for piece in PIECES]
    out.append(chunk([_completion_choice(0, "", "length")]))
    if req.stream_options.include_usage:
        out.append(chunk([], usage=USAGE))
    return out


def generate_response(req: generate_pb2.GenerateReqInput) -> generate_pb2.GenerateResponse:
    finish = common_pb2.FinishReason(kind=common_pb2.FinishReason.KIND_LENGTH)
    meta = generate_pb2.MetaInfo(prompt_tokens=3, completion_tokens=2)
    output = generate_pb2.GenerateOutput(
        rid=f"{req.rid}-0", text="".join(PIECES), output_ids=[7, 8], finish_reason=finish,
        meta_info=meta,
    )  # fmt: skip
    return generate_pb2.GenerateResponse(outputs=[output])


class FakeFrontendServicer(frontend_pb2_grpc.FrontendServiceServicer):
    """Answers every FrontendService RPC from canned protos, obeying `self.script`."""

    def __init__(self) -> None:
        self.script = Script()
        self.observed = Observed()

    def reset(self) -> None:
        self.script = Script()
        self.observed = Observed()

    async def _enter(
        self,
        name: str,
        request: Any,
        context: grpc.aio.ServicerContext,
        multiplexed: bool = False,
    ) -> None:
        self.observed.requests.append((name, request))
        self.observed.metadata.append({k: str(v) for k, v in context.invocation_metadata()})
        script = self.script
        if script.delay_s:
            await self._sleep(script.delay_s, self.observed)
        if script.fail_code is not None and script.fail_after == 0:
            await self._fail(None if multiplexed else context, script)

    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext | None, script: Script) -> None:
        """Fail the way the real services do: the message and, in the rich status, the
        field (services/common/errors.py). A multiplexed stream (no context of its
        own) raises the error, which becomes its end status."""
        error = TokenlineError(script.fail_message, field=script.fail_field)
        error.code = script.fail_code
        if context is None:
            raise error
        status = error.status()
        await context.abort(status.code, script.fail_message, status.trailing_metadata)

    @staticmethod
    async def _sleep(seconds: float, observed: Observed) -> None:
        """Sleep; a cancelled RPC lands here as CancelledError, which tests wait for."""
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            observed.cancelled.set()
            raise

    async def _stream(
        self,
        name: str,
        request: Any,
        context: grpc.aio.ServicerContext,
        items: list[Any],
        multiplexed: bool = False,
    ) -> AsyncIterator[Any]:
        await self._enter(name, request, context, multiplexed)
        script, observed = self.script, self.observed
        for sent, item in enumerate(items):
            if script.fail_code is not None and sent == script.fail_after:
                await self._fail(None if multiplexed else context, script)
            if script.hang_after is not None and sent == script.hang_after:
                await self._sleep(3600, observed)
            yield item

    async def Multiplex(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """The real frontend's multiplexing (services/frontend/multiplex.py) over these
        canned streams, each recorded under its per-request RPC's name."""

        def open_stream(request: frontend_pb2.MuxRequest) -> AsyncIterator[Any]:
            if request.WhichOneof("kind") == "chat":
                chunks = chat_chunks(request.chat)
                return self._stream("ChatCompletionStream", request.chat, context, chunks, True)
            chunks = completion_chunks(request.completion)
            return self._stream("CompletionStream", request.completion, context, chunks, True)

        self.observed.multiplex_calls += 1
        async for batch in serve_multiplexed(request_iterator, open_stream, StreamBudget(None)):
            yield batch

    async def ChatCompletion(self, request: Any, context: Any) -> Any:
        await self._enter("ChatCompletion", request, context)
        return chat_completion(request)

    async def ChatCompletionStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        async for item in self._stream(
            "ChatCompletionStream", request, context, chat_chunks(request)
        ):
            yield item

    async def Completion(self, request: Any, context: Any) -> Any:
        await self._enter("Completion", request, context)
        return completion(request)

    async def CompletionStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        async for item in self._stream(
            "CompletionStream", request, context, completion_chunks(request)
        ):
            yield item

    async def Generate(self, request: Any, context: Any) -> Any:
        await self._enter("Generate", request, context)
        return generate_response(request)

    async def GenerateStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        async for item in self._stream(
            "GenerateStream", request, context, [generate_response(request)]
        ):
            yield item

    async def Tokenize(self, request: Any, context: Any) -> Any:
        await self._enter("Tokenize", request, context)
        ids = [ord(c) for c in request.prompt]
        return frontend_pb2.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=4096)

    async def Detokenize(self, request: Any, context: Any) -> Any:
        await self._enter("Detokenize", request, context)
        bad = [t for t in request.tokens if not 0 <= t < FAKE_VOCAB]
        if bad:  # as the real frontend refuses ids outside its vocabulary
            error = InvalidArgumentError(
                f"token ids outside [0, {FAKE_VOCAB}): {bad[:5]}", field="tokens"
            )
            status = error.status()
            await context.abort(status.code, error.message, status.trailing_metadata)
        return frontend_pb2.DetokenizeResponse(prompt="".join(chr(t) for t in request.tokens))

    async def ListModels(self, request: Any, context: Any) -> Any:
        await self._enter("ListModels", request, context)
        models = [
            openai_pb2.Model(id=m, object="model", created=CREATED, owned_by="tokenline")
            for m in self.script.models
        ]
        return openai_pb2.ModelList(object="list", data=models)

    async def ResponsesCreate(self, request: Any, context: Any) -> Any:
        await self._enter("ResponsesCreate", request, context)
        return response_of(request)

    async def ResponsesCreateStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        async for item in self._stream(
            "ResponsesCreateStream", request, context, response_events(request)
        ):
            yield item

    async def ResponsesGet(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("ResponsesGet", request, context)

    async def ResponsesGetStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """The replay of a background response: the create stream's events after
        ``starting_after`` (all of them without it)."""
        first = request.starting_after + 1 if request.HasField("starting_after") else 0
        events = response_events(responses_pb2.ResponsesRequest())[first:]
        async for item in self._stream("ResponsesGetStream", request, context, events):
            yield item

    async def ResponsesInputItems(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("ResponsesInputItems", request, context)

    async def ResponsesDelete(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("ResponsesDelete", request, context)

    async def ResponsesCancel(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("ResponsesCancel", request, context)

    async def Embed(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("Embed", request, context)

    async def _empty_reply(self, name: str, request: Any, context: Any) -> Any:
        """The RPC's reply message with no fields set: for the operator and session calls,
        whose rendering by the gateway is all a test over this fake can check."""
        await self._enter(name, request, context)
        method = frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"].methods_by_name[name]
        return message_factory.GetMessageClass(method.output_type)()

    async def Abort(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("Abort", request, context)

    async def CloseSession(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("CloseSession", request, context)

    async def FlushCache(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("FlushCache", request, context)

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("GetInfo", request, context)

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("GetModelInfo", request, context)

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("GetServerInfo", request, context)

    async def OpenSession(self, request: Any, context: Any) -> Any:
        return await self._empty_reply("OpenSession", request, context)


def response_of(request: responses_pb2.ResponsesRequest) -> responses_pb2.Response:
    """A completed response whose message is PIECES joined."""
    out = responses_pb2.Response(id="resp_fake", object="response", model=MODEL_ID)
    out.status = "completed"
    item = out.output.add(type="message", id="msg_fake", status="completed", role="assistant")
    item.content.add(type="output_text", text="".join(PIECES))
    out.usage.input_tokens, out.usage.output_tokens = 5, len(PIECES)
    return out


def response_events(
    request: responses_pb2.ResponsesRequest,
) -> list[responses_pb2.ResponseStreamEvent]:
    """created, one delta per piece, completed (the frontend's events in short)."""
    event = responses_pb2.ResponseStreamEvent
    whole = response_of(request)
    out = [event(type="response.created", response=responses_pb2.Response(id="resp_fake"))]
    for piece in PIECES:
        out.append(event(type="response.output_text.delta", item_id="msg_fake", delta=piece))
    out.append(event(type="response.completed", response=whole))
    for i, item in enumerate(out):
        item.sequence_number = i
    return out


class FakeFrontend:
    """Runs FakeFrontendServicer (+ the standard health service) on a background loop."""

    def __init__(self, port: int = 0) -> None:
        self.servicer = FakeFrontendServicer()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._health = health.aio.HealthServicer()
        self.port = port

    def start(self) -> FakeFrontend:
        self._thread.start()
        self._run(self._start())
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, is_serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING
        if not is_serving:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        self._run(self._health.set(READINESS_SERVICE, status))

    def stop(self) -> None:
        self._run(self._server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        frontend_pb2_grpc.add_FrontendServiceServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self._server.start()
        await self._health.set(READINESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
