"""Reasoning parsers: a choice's text -> reasoning and content, incrementally.

DeepSeek-R1 and Qwen3 write their reasoning between ``<think>`` and ``</think>``; what
follows is the answer. One parser per choice: ``feed(text)`` returns what is now certain,
``finish()`` flushes what was held back (only a possible start of a tag is), and
``parse(text)`` is both on the whole text, so streamed deltas concatenate to the
non-streamed split however the text was cut.

Where the reasoning starts:

* ``deepseek_r1``: at the first token (R1's template opens the block in the prompt; a
  ``<think>`` the model writes anyway is dropped). No ``</think>``: all of it is reasoning.
* ``qwen3``: only where the model opens it with ``<think>`` at the start of its output, or
  where the prompt already did (Qwen3 thinking models' templates end in ``<think>\\n``).
  With ``enable_thinking: false`` the template closes the block in the prompt and the
  whole output is content.

``chat_template_kwargs`` with ``enable_thinking`` or ``thinking`` set false turns R1's
implicit start off too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from services.frontend.parsers.tool_calls import held_prefix

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def extend(self, other: ReasoningDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


class ReasoningParser:
    """``<think>…</think>`` then content; subclasses say whether reasoning is implicit."""

    NAME: ClassVar[str]
    # The model starts inside the block unless the request turned thinking off.
    IMPLICIT_START: ClassVar[bool] = False

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self.state = "start"  # start -> reasoning -> content
        self.buf = ""
        self.has_reasoned = False  # entered the block
        self.has_ended = False  # saw its end

    @classmethod
    def starts_inside(cls, prompt_tail: str, template_kwargs: dict[str, Any]) -> bool:
        """Whether the output begins inside the block, from the prompt's last characters
        and the request's template switches."""
        if prompt_tail.rstrip().endswith(THINK_START):
            return True
        thinking_off = any(template_kwargs.get(k) is False for k in ("enable_thinking", "thinking"))
        return cls.IMPLICIT_START and not thinking_off

    def feed(self, text: str) -> ReasoningDelta:
        self.buf += text
        out = ReasoningDelta()
        while self.buf and self._step(out, final=False):
            pass
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        while self.buf and self._step(out, final=True):
            pass
        return out

    def parse(self, text: str) -> ReasoningDelta:
        out = self.feed(text)
        out.extend(self.finish())
        return out

    def _step(self, out: ReasoningDelta, final: bool) -> bool:
        if self.state == "start":
            return self._start(final)
        if self.state == "content":
            out.content += self.buf
            self.buf = ""
            return False
        self.has_reasoned = True
        i = self.buf.find(THINK_END)
        if i >= 0:
            out.reasoning += self.buf[:i]
            self.buf = self.buf[i + len(THINK_END) :]
            self.state, self.has_ended = "content", True
            return True
        keep = 0 if final else held_prefix(self.buf, THINK_END)
        out.reasoning += self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]
        return final and bool(self.buf)

    def _start(self, final: bool) -> bool:
        """An opening tag at the very start (after whitespace) opens the block."""
        head = self.buf.lstrip()
        if head.startswith(THINK_START):
            self.buf = head[len(THINK_START) :]
            self.state = "reasoning"
            self.has_reasoned = True
            return True
        if THINK_START.startswith(head) and not final:
            return False
        self.state = "reasoning" if self.starts_in_reasoning else "content"
        return True


class DeepSeekR1Parser(ReasoningParser):
    NAME = "deepseek_r1"
    IMPLICIT_START = True


class Qwen3Parser(ReasoningParser):
    NAME = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1Parser,
    "qwen3": Qwen3Parser,
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser registered as ``name`` (a flag's value); ValueError names the choices."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        choices = sorted(REASONING_PARSERS)
        raise ValueError(f"unknown reasoning parser {name!r}; one of {choices}") from None


def num_reasoning_tokens(
    parser: ReasoningParser, output_ids: list[int], decode: Callable[[list[int]], str]
) -> int:
    """Completion tokens spent reasoning: up to and including the one that completed
    ``</think>`` (however the model spelled it in tokens), all of them when the block
    never closed, none when there was no block. A binary search over decoded prefixes:
    a longer prefix only ever adds text."""
    if not parser.has_reasoned:
        return 0
    if not parser.has_ended or THINK_END not in decode(output_ids):
        return len(output_ids)
    lo, hi = 1, len(output_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_END in decode(output_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
