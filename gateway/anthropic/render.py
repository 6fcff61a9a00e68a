"""Chat answers → Anthropic Messages: a whole ``message``, or a stream's events.

The frontend answers a Messages request as the chat request it was translated into
(``convert.py``); this module says the same things in Anthropic's words. A stream's events
come in Anthropic's order: ``message_start``; per content block ``content_block_start``,
its deltas (``text_delta`` / ``input_json_delta``) and ``content_block_stop``; then
``message_delta`` (stop_reason, stop_sequence, usage) and ``message_stop``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from tokenline.v1 import openai_pb2

from gateway.anthropic.responses import (
    MessageResponse,
    MessageUsage,
    StopReason,
    TextBlock,
    ToolUseBlock,
)
from gateway.anthropic_errors import anthropic_error_body
from gateway.errors import GatewayError

_STOP_REASON_OF: dict[str, StopReason] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
}


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def stop_of(
    finish_reason: str, matched: str | None, stop_sequences: list[str]
) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence): a stop on one of the client's stop_sequences is
    ``stop_sequence``; an aborted request is an error, which Anthropic's reasons cannot say."""
    if finish_reason == "abort":
        raise GatewayError(500, f"the request was aborted ({matched or 'no reason given'})")
    if finish_reason == "stop" and matched is not None and matched in stop_sequences:
        return "stop_sequence", matched
    return _STOP_REASON_OF.get(finish_reason, "end_turn"), None


def _matched_str(choice: Any) -> str | None:
    return choice.matched_str if choice.WhichOneof("matched_stop") == "matched_str" else None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the JSON object Anthropic's ``input`` is."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise GatewayError(500, "a tool call's arguments are not a JSON object")
    return value


def _usage(usage: openai_pb2.CompletionUsage) -> MessageUsage:
    return MessageUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)


def message_to_dict(
    completion: openai_pb2.ChatCompletion, stop_sequences: list[str]
) -> dict[str, Any]:
    """The non-streamed ``message``."""
    choice = completion.choices[0]
    reason, sequence = stop_of(choice.finish_reason, _matched_str(choice), stop_sequences)
    content: list[TextBlock | ToolUseBlock] = []
    if choice.message.content:
        content.append(TextBlock(type="text", text=choice.message.content))
    for call in choice.message.tool_calls:
        block = ToolUseBlock(
            type="tool_use",
            id=call.id,
            name=call.function.name,
            input=tool_input(call.function.arguments),
        )
        content.append(block)
    return MessageResponse(
        id=message_id(completion.id),
        type="message",
        role="assistant",
        model=completion.model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=_usage(completion.usage),
    ).dump()


def event(name: str, data: dict[str, Any]) -> bytes:
    """One SSE event: Anthropic names it twice, as ``event:`` and as ``data.type``."""
    payload = json.dumps({"type": name, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()


BlockKind = Literal["text", "tool_use"]


PING = event("ping", {})


class MessageEvents:
    """One stream's events (a ``gateway/sse.py`` Framer): ``event`` with each chat chunk,
    then ``end()`` after the last, or ``fail(error)`` in its place. Text and each tool call
    are blocks of their own, opened at their first delta and closed when another begins.
    A ``ping`` follows ``message_start``, as Anthropic sends one there, and is the
    keep-alive of a silent stream (the SDKs skip it)."""

    def __init__(self, stop_sequences: list[str]) -> None:
        self.stop_sequences = stop_sequences
        self.is_started = False
        self.num_blocks = 0
        self.open_block: BlockKind | None = None
        self.finish: tuple[str, str | None] = ("stop", None)
        self.usage = openai_pb2.CompletionUsage()

    def event(self, chunk: openai_pb2.ChatCompletionChunk) -> bytes:
        out: list[bytes] = []
        if not self.is_started:
            out += [self._start(chunk), PING]
        for choice in chunk.choices:
            if choice.delta.content:
                out += self._text(choice.delta.content)
            for call in choice.delta.tool_calls:
                out += self._tool_call(call)
            if choice.HasField("finish_reason"):
                self.finish = (choice.finish_reason, _matched_str(choice))
        if chunk.HasField("usage"):
            self.usage = chunk.usage
        return b"".join(out)

    def end(self) -> bytes:
        try:
            reason, sequence = stop_of(*self.finish, self.stop_sequences)
        except GatewayError as err:
            return self.fail(err)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        usage = _usage(self.usage).dump()
        return b"".join(
            [*self._close(), event("message_delta", {"delta": delta, "usage": usage}),
             event("message_stop", {})]
        )  # fmt: skip

    def fail(self, err: GatewayError) -> bytes:
        return event(
            "error", {"error": anthropic_error_body(err.status, err.message, err.param)["error"]}
        )

    def keepalive(self) -> bytes:
        return PING

    def _start(self, chunk: openai_pb2.ChatCompletionChunk) -> bytes:
        self.is_started = True
        message = MessageResponse(
            id=message_id(chunk.id),
            type="message",
            role="assistant",
            model=chunk.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=MessageUsage(input_tokens=len(chunk.prompt_token_ids), output_tokens=0),
        )
        return event("message_start", {"message": message.dump()})

    def _open(self, kind: BlockKind, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.open_block = kind
        out.append(event("content_block_start", {"index": self.num_blocks, "content_block": block}))
        return out

    def _close(self) -> list[bytes]:
        if self.open_block is None:
            return []
        self.open_block = None
        self.num_blocks += 1
        return [event("content_block_stop", {"index": self.num_blocks - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.num_blocks, "delta": delta})

    def _text(self, text: str) -> list[bytes]:
        out = [] if self.open_block == "text" else self._open("text", {"type": "text", "text": ""})
        out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def _tool_call(self, call: openai_pb2.ToolCall) -> list[bytes]:
        out: list[bytes] = []
        if call.id:  # a call's first delta carries its id and name
            block = {"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}}
            out = self._open("tool_use", block)
        if call.function.arguments:
            out.append(
                self._delta({"type": "input_json_delta", "partial_json": call.function.arguments})
            )
        return out
