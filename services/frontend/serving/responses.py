"""The Responses API on the chat path: translate the request (``responses_input.py``), run
it as chat, say the answer in Responses' words (``responses_output.py``,
``responses_events.py``), and keep it when asked (``response_store.py``). Nothing here
templates, samples or parses on its own."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterator

from tokenline.v1 import openai_pb2, responses_pb2

from services.common.auth.caller import caller_name, may_touch
from services.common.errors import InvalidArgumentError
from services.frontend.serving.chat import ChatServing
from services.frontend.serving.response_store import ResponseStore
from services.frontend.serving.responses_events import ResponseEvents
from services.frontend.serving.responses_input import (
    chat_request_of,
    input_messages,
    output_message,
    responses_field,
)
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
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    def get(self, response_id: str) -> responses_pb2.Response:
        return self.store.get(response_id, "response_id", may_touch).response

    def _history(self, request: responses_pb2.ResponsesRequest) -> list[openai_pb2.ChatMessage]:
        """The stored conversation ``previous_response_id`` continues (none without one)."""
        if not request.previous_response_id:
            return []
        found = self.store.get(request.previous_response_id, "previous_response_id", may_touch)
        return list(found.conversation)

    def _chat_request(
        self, request: responses_pb2.ResponsesRequest, *, stream: bool
    ) -> tuple[openai_pb2.ChatCompletionRequest, list[openai_pb2.ChatMessage]]:
        """The chat request, and the conversation a continuation of it would start from
        (its history and input; the output is added once known)."""
        history = self._history(request)
        with _named_as_responses():
            chat = chat_request_of(request, stream=stream, history=history)
        return chat, [*history, *input_messages(request)]

    def _keep(
        self, response: responses_pb2.Response, conversation: list[openai_pb2.ChatMessage]
    ) -> None:
        """Store a finished response (when it asked to be) for later continuations."""
        if response.store:
            conversation = [*conversation, output_message(response)]
            self.store.put(response, conversation, owner=caller_name())

    async def create(self, request: responses_pb2.ResponsesRequest) -> responses_pb2.Response:
        chat, conversation = self._chat_request(request, stream=False)
        with _named_as_responses():
            completion = await self.chat.complete(chat)
        response = response_of(request, _label(completion.id), completion)
        self._keep(response, conversation)
        return response

    async def stream(
        self, request: responses_pb2.ResponsesRequest
    ) -> AsyncGenerator[responses_pb2.ResponseStreamEvent, None]:
        chat, conversation = self._chat_request(request, stream=True)
        chunks = self.chat.stream(chat)
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
            last = events.end()
            self._keep(response, conversation)
            for event in last:
                yield event
        finally:
            await chunks.aclose()
