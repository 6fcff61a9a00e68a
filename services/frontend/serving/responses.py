"""The Responses API on the chat path: translate the request (``responses_input.py``), run
it as chat, say the answer in Responses' words (``responses_output.py``,
``responses_events.py``). Nothing here templates, samples or parses on its own."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterator

from tokenline.v1 import responses_pb2

from services.common.errors import InvalidArgumentError
from services.frontend.serving.chat import ChatServing
from services.frontend.serving.responses_events import ResponseEvents
from services.frontend.serving.responses_input import chat_request_of, responses_field
from services.frontend.serving.responses_output import new_response, response_of


@contextlib.contextmanager
def _named_as_responses() -> Iterator[None]:
    """A chat validation error names the Responses field the client sent."""
    try:
        yield
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(exc.message, field=responses_field(exc.field)) from None


def _label(chat_id: str) -> str:
    return chat_id.removeprefix("chatcmpl-")


class ResponsesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, request: responses_pb2.ResponsesRequest) -> responses_pb2.Response:
        with _named_as_responses():
            completion = await self.chat.complete(chat_request_of(request, stream=False))
        return response_of(request, _label(completion.id), completion)

    async def stream(
        self, request: responses_pb2.ResponsesRequest
    ) -> AsyncGenerator[responses_pb2.ResponseStreamEvent, None]:
        chunks = self.chat.stream(chat_request_of(request, stream=True))
        try:
            with _named_as_responses():
                first = await anext(chunks)  # the role chunk: every check has passed
            response = new_response(request, _label(first.id), first.created, first.model)
            events = ResponseEvents(response)
            for event in events.start():
                yield event
            async for chunk in chunks:
                for event in events.feed(chunk):
                    yield event
            for event in events.end():
                yield event
        finally:
            await chunks.aclose()
