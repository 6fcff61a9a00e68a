"""One choice's text -> OpenAI chat output: reasoning, content and tool calls.

A request's ``ChatParsing`` says which parsers its choices run (decided once, while the
request is prepared); a ``ChoiceParser`` runs them on one choice: the reasoning parser
first, then the tool-call parser on what is content. The streamed path feeds each row's
text delta, the non-streamed path the whole text; both parsers give the same result for
any split of a text, so the streamed deltas concatenate to the non-streamed message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenline.v1 import common_pb2, openai_pb2

from services.frontend.parsers.reasoning import (
    ReasoningDelta,
    ReasoningParser,
    num_reasoning_tokens,
)
from services.frontend.parsers.tool_calls import ToolCallDelta, ToolParser, merge_calls
from services.frontend.serving.output import finish_name


@dataclass(frozen=True, slots=True)
class ChatParsing:
    """Which parsers a request's choices run; the default runs none (all is content)."""

    reasoning: type[ReasoningParser] | None = None
    starts_in_reasoning: bool = False
    tools: Callable[[], ToolParser] | None = None  # makes a choice's tool-call reader

    @property
    def reads_reasoning(self) -> bool:
        return self.reasoning is not None

    def new_choice(self) -> ChoiceParser:
        return ChoiceParser(self)


@dataclass(slots=True)
class ChatPieces:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ChatPieces) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChoiceParser:
    def __init__(self, parsing: ChatParsing) -> None:
        self.reasoning = (
            None if parsing.reasoning is None else parsing.reasoning(parsing.starts_in_reasoning)
        )
        self.tools = None if parsing.tools is None else parsing.tools()

    def feed(self, text: str) -> ChatPieces:
        if self.reasoning is None:
            return self._read_calls(ReasoningDelta(content=text), final=False)
        return self._read_calls(self.reasoning.feed(text), final=False)

    def finish(self) -> ChatPieces:
        split = ReasoningDelta() if self.reasoning is None else self.reasoning.finish()
        return self._read_calls(split, final=True)

    def parse(self, text: str) -> ChatPieces:
        """The whole text at once (the non-streamed message); calls merged, one each."""
        out = self.feed(text)
        out.extend(self.finish())
        out.calls = merge_calls(out.calls)
        return out

    def _read_calls(self, split: ReasoningDelta, final: bool) -> ChatPieces:
        out = ChatPieces(reasoning=split.reasoning, content=split.content)
        if self.tools is not None:
            found = self.tools.feed(split.content)
            if final:
                found.extend(self.tools.finish())
            out.content, out.calls = found.content, found.calls
        return out

    @property
    def num_calls(self) -> int:
        return 0 if self.tools is None else self.tools.num_calls

    def finish_reason(self, finish: common_pb2.FinishReason) -> str:
        """``tool_calls`` when the choice stopped (not cut off) after calling tools."""
        name = finish_name(finish)
        return "tool_calls" if name == "stop" and self.num_calls else name

    def num_reasoning_tokens(
        self, output_ids: list[int], decode: Callable[[list[int]], str]
    ) -> int:
        if self.reasoning is None:
            return 0
        return num_reasoning_tokens(self.reasoning, output_ids, decode)


def fill_delta(delta: openai_pb2.ChatDelta, pieces: ChatPieces) -> None:
    """A stream chunk's delta; a call's deltas within one chunk merge into one entry.
    A delta with nothing else (a chunk for logprobs only) says ``content: ""``."""
    if pieces.reasoning:
        delta.reasoning_content = pieces.reasoning
    if pieces.content or not (pieces.reasoning or pieces.calls):
        delta.content = pieces.content
    entries: dict[int, openai_pb2.ToolCall] = {}
    for call in pieces.calls:
        entry = entries.get(call.index)
        if entry is None:
            entry = entries[call.index] = delta.tool_calls.add(index=call.index)
        if call.id:
            entry.id, entry.type, entry.function.name = call.id, "function", call.name
        entry.function.arguments += call.arguments


def fill_message(
    message: openai_pb2.ChatResponseMessage, pieces: ChatPieces, reasons: bool
) -> None:
    """The non-streamed message: content null beside tool calls when there is none, and
    reasoning_content set when a reasoning parser ran (``reasons``) and found some."""
    message.role = "assistant"
    if pieces.content or not pieces.calls:
        message.content = pieces.content
    if reasons and pieces.reasoning:
        message.reasoning_content = pieces.reasoning
    for call in pieces.calls:
        message.tool_calls.add(
            id=call.id,
            type="function",
            index=call.index,
            function=openai_pb2.ToolCallFunction(name=call.name, arguments=call.arguments),
        )


def set_reasoning_tokens(usage: openai_pb2.CompletionUsage, num_tokens: int) -> None:
    usage.completion_tokens_details.reasoning_tokens = num_tokens
