"""A chat stream → the Responses API's typed events, each with its ``sequence_number``.

One item is open at a time: a chunk of another kind (reasoning, text, a new tool call)
closes the open item before it opens its own, so every item's events come as one run:
``output_item.added``, its part and deltas, ``output_item.done``. The text deltas are the
chat deltas unchanged, so they concatenate to the unary response's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from tokenline.v1 import openai_pb2, responses_pb2

from services.frontend.serving.response_event_log import ResponseEventLog
from services.frontend.serving.responses_output import (
    call_item,
    finish,
    message_item,
    reasoning_item,
    usage_of,
)

Event: TypeAlias = responses_pb2.ResponseStreamEvent


@dataclass(slots=True)
class _OpenItem:
    kind: str  # "message" | "reasoning" | "function_call"
    item: responses_pb2.ResponseOutputItem
    text: str = ""
    call_index: int = -1  # function_call: the chat tool call's index


class ResponseEvents:
    """Events for one streamed response; ``response`` is the object the events carry.
    With ``log`` (a background response), every event made is also kept there."""

    def __init__(
        self, response: responses_pb2.Response, log: ResponseEventLog | None = None
    ) -> None:
        self.response = response
        self.log = log
        self.label = response.id.removeprefix("resp_")
        self._seq = 0
        self._open: _OpenItem | None = None
        self._finish_reason = "stop"

    def _event(self, type_: str, **fields: object) -> Event:
        event = Event(type=type_, sequence_number=self._seq, **fields)  # type: ignore[arg-type]
        self._seq += 1
        if self.log is not None:
            self.log.append(event)
        return event

    def _index(self) -> int:
        return len(self.response.output)

    def start(self) -> list[Event]:
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]

    def feed(self, chunk: openai_pb2.ChatCompletionChunk) -> list[Event]:
        """Events for one chat chunk (choice 0: a response has one)."""
        out: list[Event] = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                out += self._text("reasoning", delta.reasoning_content)
            if delta.content:
                out += self._text("message", delta.content)
            for call in delta.tool_calls:
                out += self._call(call)
            if choice.HasField("finish_reason"):
                self._finish_reason = choice.finish_reason
        if chunk.HasField("usage") and not chunk.choices:
            self.response.usage.CopyFrom(usage_of(chunk.usage))
        return out

    def end(self) -> list[Event]:
        """Close the open item (or write an empty message) and end the response."""
        finish(self.response, self._finish_reason)
        out = self._close()
        if not self.response.output:
            out += self._text("message", "") + self._close()
        done = (
            "response.completed" if self.response.status == "completed" else "response.incomplete"
        )
        return [*out, self._event(done, response=self.response)]

    def stopped(self) -> list[Event]:
        """The last event of a run that did not end on its own: ``response.failed``, or
        ``response.cancelled`` (not an OpenAI event type: OpenAI has none for a cancel),
        as ``response.status`` says."""
        return [self._event(f"response.{self.response.status}", response=self.response)]

    def _text(self, kind: str, delta: str) -> list[Event]:
        out: list[Event] = []
        opened = self._open
        if opened is None or opened.kind != kind:
            out += self._close()
            opened = self._start(_OpenItem(kind, self._text_item(kind)), out)
        opened.text += delta
        if delta:
            name = "output_text" if kind == "message" else "reasoning_text"
            out.append(self._event(f"response.{name}.delta", delta=delta, **self._where(opened)))
        return out

    def _text_item(self, kind: str) -> responses_pb2.ResponseOutputItem:
        if kind == "reasoning":
            return reasoning_item(self.label, "", "in_progress")
        item = message_item(self.label, "", "in_progress")
        del item.content[:]  # its part comes with content_part.added
        return item

    def _start(self, opened: _OpenItem, out: list[Event]) -> _OpenItem:
        """Open ``opened``: its added events go to ``out``."""
        self._open = opened
        index = self._index()
        out.append(self._event("response.output_item.added", output_index=index, item=opened.item))
        if opened.kind == "message":
            part = responses_pb2.ResponseOutputText(type="output_text", text="")
            where = self._where(opened)
            out.append(self._event("response.content_part.added", part=part, **where))
        return opened

    def _call(self, call: openai_pb2.ToolCall) -> list[Event]:
        out: list[Event] = []
        opened = self._open
        if opened is None or opened.call_index != call.index:
            out += self._close()
            count = sum(item.type == "function_call" for item in self.response.output)
            item = call_item(self.label, count, call, "in_progress")
            item.arguments = ""
            opened = self._start(_OpenItem("function_call", item, call_index=call.index), out)
        if call.function.arguments:
            opened.text += call.function.arguments
            delta = call.function.arguments
            where = self._where(opened)
            out.append(self._event("response.function_call_arguments.delta", delta=delta, **where))
        return out

    def _where(self, opened: _OpenItem) -> dict[str, object]:
        return {"output_index": self._index(), "item_id": opened.item.id}

    def _close(self) -> list[Event]:
        """Done events for the open item, which joins ``response.output``."""
        opened, self._open = self._open, None
        if opened is None:
            return []
        where = self._where(opened)
        item, text, out = opened.item, opened.text, []
        if opened.kind == "message":
            item.status = "incomplete" if self._finish_reason == "length" else "completed"
            part = responses_pb2.ResponseOutputText(type="output_text", text=text)
            item.content.append(part)
            out.append(self._event("response.output_text.done", text=text, **where))
            out.append(self._event("response.content_part.done", part=part, **where))
        elif opened.kind == "reasoning":
            item.status, item.reasoning_text = "completed", text
            out.append(self._event("response.reasoning_text.done", text=text, **where))
        else:
            item.status, item.arguments = "completed", text
            out.append(
                self._event("response.function_call_arguments.done", arguments=text, **where)
            )
        out.append(
            self._event("response.output_item.done", item=item, output_index=where["output_index"])
        )
        self.response.output.append(item)
        return out
