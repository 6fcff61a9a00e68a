"""The Responses API on the chat path: translate the request (``responses_input.py``), run
it as chat, say the answer in Responses' words (``responses_output.py``,
``responses_events.py``), and keep it when asked (``response_store.py``). Nothing here
templates, samples or parses on its own.

A ``background`` response is the streamed path with nobody listening: the RPC answers once
the request is dispatched (every check passed), a task feeds the chat stream into the
response the store holds, so ResponsesGet shows it growing (items as they close) and
finished; ResponsesCancel or dropping the entry cancels the task, which aborts the
request upstream as a client's cancel does. Every event the run makes is kept in the
entry's event log: a background create with ``stream`` and ResponsesGetStream both follow
that log, so a client that leaves stops following and the run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass

from tokenline.v1 import openai_pb2, responses_pb2

from services.common.auth.caller import caller_name, may_touch
from services.common.errors import InvalidArgumentError, TokenlineError
from services.frontend.serving.chat import ChatServing
from services.frontend.serving.response_event_log import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_EVENTS,
    ResponseEventLog,
)
from services.frontend.serving.response_store import ResponseStore
from services.frontend.serving.responses_events import ResponseEvents
from services.frontend.serving.responses_input import (
    chat_request_of,
    input_messages,
    output_message,
    responses_field,
)
from services.frontend.serving.responses_items import input_items_of, page_of, paging_of
from services.frontend.serving.responses_output import new_response, response_of

logger = logging.getLogger(__name__)

Chunks = AsyncGenerator[openai_pb2.ChatCompletionChunk, None]
Events = AsyncIterator[responses_pb2.ResponseStreamEvent]
_CONTINUABLE = ("completed", "incomplete")


@contextlib.contextmanager
def _named_as_responses() -> Iterator[None]:
    """A chat validation error names the Responses field the client sent."""
    try:
        yield
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(exc.message, field=responses_field(exc.field)) from None


def _label(chat_id: str) -> str:
    return chat_id.removeprefix("chatcmpl-")


@dataclass(slots=True)
class _Turn:
    """One request as the chat path runs it, and what storing its response needs."""

    request: responses_pb2.ResponsesRequest
    chat: openai_pb2.ChatCompletionRequest
    # What a continuation starts from: the history and this input (the output is added
    # once known), as chat messages and as listed items.
    conversation: list[openai_pb2.ChatMessage]
    history_items: list[responses_pb2.ResponseOutputItem]

    def items(self, label: str) -> list[responses_pb2.ResponseOutputItem]:
        return [*self.history_items, *input_items_of(self.request, label)]


class ResponsesServing:
    def __init__(
        self,
        chat: ChatServing,
        store: ResponseStore | None = None,
        *,
        log_max_events: int = DEFAULT_MAX_EVENTS,
        log_max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()
        self.log_bounds = (log_max_events, log_max_bytes)
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, response_id: str) -> responses_pb2.Response:
        return self.store.get(response_id, "response_id", may_touch).response

    async def replay(self, request: responses_pb2.ResponsesGetStreamRequest) -> Events:
        """A background response's events after ``starting_after`` (all without it), then
        its new ones while it runs, ending with its terminal event. NOT_FOUND as ``get``;
        a response not made in the background is refused naming ``stream``."""
        found = self.store.get(request.response_id, "response_id", may_touch)
        if found.events is None:
            raise InvalidArgumentError(
                f"stream: response {request.response_id!r} was not created with background: "
                "true; only a background response can be streamed again (GET it without stream)",
                field="stream",
            )
        after = request.starting_after if request.HasField("starting_after") else None
        async for event in found.events.follow(after):
            yield event

    def input_items(
        self, request: responses_pb2.ResponsesInputItemsRequest
    ) -> responses_pb2.ResponseItemList:
        paging_of(request)  # a bad page is refused whether or not the id is known
        found = self.store.get(request.response_id, "response_id", may_touch)
        return page_of(found.items, request)

    def delete(self, response_id: str) -> responses_pb2.ResponseDeleted:
        """Forget a response; one still running in the background is cancelled."""
        self.store.delete(response_id, may_touch)
        return responses_pb2.ResponseDeleted(id=response_id, object="response", deleted=True)

    def cancel(self, response_id: str) -> responses_pb2.Response:
        """Cancel a background response while it runs (again: the same answer); any other
        is refused as OpenAI refuses it."""
        found = self.store.get(response_id, "response_id", may_touch)
        response = found.response
        if not response.background:
            raise InvalidArgumentError("Cannot cancel a synchronous response.", field="response_id")
        if response.status == "in_progress" and found.stop is not None:
            found.stop()
            response.status = "cancelled"
        elif response.status != "cancelled":
            raise InvalidArgumentError(
                f"Cannot cancel a response that is already {response.status}.",
                field="response_id",
            )
        return response

    def _turn(self, request: responses_pb2.ResponsesRequest, *, stream: bool) -> _Turn:
        """The chat request, after the stored conversation ``previous_response_id``
        continues (none without one)."""
        history: list[openai_pb2.ChatMessage] = []
        history_items: list[responses_pb2.ResponseOutputItem] = []
        if request.previous_response_id:
            found = self.store.get(request.previous_response_id, "previous_response_id", may_touch)
            if found.response.status not in _CONTINUABLE:
                raise InvalidArgumentError(
                    f"response {request.previous_response_id!r} is {found.response.status}; "
                    "only a completed or incomplete response can be continued",
                    field="previous_response_id",
                )
            history = list(found.conversation)
            history_items = [*found.items, *found.response.output]
        with _named_as_responses():
            chat = chat_request_of(request, stream=stream, history=history)
        return _Turn(request, chat, [*history, *input_messages(request)], history_items)

    def _keep(
        self, response: responses_pb2.Response, turn: _Turn, log: ResponseEventLog | None = None
    ) -> None:
        """Store a finished response (when it asked to be) for later continuations, with
        the event log of a background one."""
        if response.store:
            conversation = [*turn.conversation, output_message(response)]
            items = turn.items(response.id.removeprefix("resp_"))
            self.store.put(response, conversation, caller_name(), items=items, events=log)

    async def create(self, request: responses_pb2.ResponsesRequest) -> responses_pb2.Response:
        if request.background:
            answer, _ = await self._start_in_background(request)
            return answer
        turn = self._turn(request, stream=False)
        with _named_as_responses():
            completion = await self.chat.complete(turn.chat)
        response = response_of(request, _label(completion.id), completion)
        self._keep(response, turn)
        return response

    async def _open(
        self, turn: _Turn, log: ResponseEventLog | None = None
    ) -> tuple[Chunks, ResponseEvents]:
        """The chat stream, past its role chunk (every check has passed, the request is
        dispatched), and the events of its response."""
        chunks = self.chat.stream(turn.chat)
        try:
            with _named_as_responses():
                first = await anext(chunks)
        except BaseException:
            await chunks.aclose()
            raise
        response = new_response(turn.request, _label(first.id), first.created, first.model)
        return chunks, ResponseEvents(response, log)

    async def stream(self, request: responses_pb2.ResponsesRequest) -> Events:
        """The response's events; a background one's are followed from its log, so the
        caller leaving does not stop its run."""
        if request.background:
            _, log = await self._start_in_background(request)
            async for event in log.follow():
                yield event
            return
        turn = self._turn(request, stream=True)
        chunks, events = await self._open(turn)
        try:
            for event in events.start():
                yield event
            async for chunk in chunks:
                for event in events.feed(chunk):
                    yield event
            last = events.end()
            self._keep(events.response, turn)
            for event in last:
                yield event
        finally:
            await chunks.aclose()

    async def _start_in_background(
        self, request: responses_pb2.ResponsesRequest
    ) -> tuple[responses_pb2.Response, ResponseEventLog]:
        """Dispatch, store the response ``in_progress`` with its run and its event log;
        answer a copy and the log."""
        if request.HasField("store") and not request.store:
            raise InvalidArgumentError(
                "false cannot go with background: true (a background response is kept for "
                "GET /v1/responses/{id})",
                field="store",
            )
        turn = self._turn(request, stream=True)
        log = ResponseEventLog(*self.log_bounds)
        chunks, events = await self._open(turn, log)
        response = events.response
        events.start()
        run = asyncio.ensure_future(self._run(chunks, events, turn))  # the caller's context
        run.add_done_callback(lambda _: self._close_soon(chunks))
        run.add_done_callback(lambda _: _end_log(events))
        items = turn.items(response.id.removeprefix("resp_"))
        self.store.put(
            response, turn.conversation, caller_name(), items=items, stop=run.cancel, events=log
        )
        answer = responses_pb2.Response()
        answer.CopyFrom(response)
        return answer, log

    def _close_soon(self, chunks: Chunks) -> None:
        """Close the stream a run leaves open: one cancelled before its first step never
        ran its own cleanup, and its request would run on upstream."""
        if getattr(chunks, "ag_frame", None) is None:  # closed already: the run ended it
            return
        task = asyncio.ensure_future(chunks.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _run(self, chunks: Chunks, events: ResponseEvents, turn: _Turn) -> None:
        """Feed the stream into the stored response; store it again when it ends. A
        cancel (ResponsesCancel, or the entry dropped) leaves the entry as it is."""
        response = events.response
        try:
            await _feed(chunks, events)
        except asyncio.CancelledError:
            response.status = "cancelled"
            raise
        except Exception as exc:  # noqa: BLE001 - a failed run is the response's status
            _fail(response, exc)
        self._keep(response, turn, events.log)


def _end_log(events: ResponseEvents) -> None:
    """Close a finished run's log; a run that failed or was cancelled (even before its
    first step, when its own handlers never ran) first gets its terminal event."""
    log = events.log
    if log is None or log.is_closed:
        return
    if events.response.status == "in_progress":
        events.response.status = "cancelled"
    if events.response.status in ("failed", "cancelled"):
        events.stopped()
    log.close()


async def _feed(chunks: Chunks, events: ResponseEvents) -> None:
    async with contextlib.aclosing(chunks) as rest:
        async for chunk in rest:
            events.feed(chunk)
    events.end()


def _fail(response: responses_pb2.Response, exc: Exception) -> None:
    response.status = "failed"
    if isinstance(exc, TokenlineError):
        response.error.code, response.error.message = exc.code.name.lower(), exc.message
    else:
        logger.exception("background response %s failed", response.id, exc_info=exc)
        response.error.code, response.error.message = "internal", "internal error"
