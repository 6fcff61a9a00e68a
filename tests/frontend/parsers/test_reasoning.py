"""Reasoning parsers on scripted texts: the one-shot split, the same split however the
text is cut, where the block starts, and how many tokens the reasoning took."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from services.frontend.parsers.reasoning import (
    DeepSeekR1Parser,
    Qwen3Parser,
    ReasoningDelta,
    ReasoningParser,
    num_reasoning_tokens,
    reasoning_parser_class,
)
from tests.frontend.parsers.test_tool_calls import cuts

CASES = [
    # (parser, starts inside the block, text, reasoning, content)
    (DeepSeekR1Parser, True, "Let me think.</think>\n\nIt is 4.", "Let me think.", "\n\nIt is 4."),
    (DeepSeekR1Parser, True, "<think>\nhmm</think>ok", "\nhmm", "ok"),
    (DeepSeekR1Parser, True, "cut off while thinking </thi", "cut off while thinking </thi", ""),
    (DeepSeekR1Parser, True, "a < b </think", "a < b </think", ""),
    (DeepSeekR1Parser, False, "no block: an answer", "", "no block: an answer"),
    (Qwen3Parser, False, "<think>\nstep</think>\n\nanswer", "\nstep", "\n\nanswer"),
    (Qwen3Parser, False, "\n<think>a</think>b</think>", "a", "b</think>"),
    (Qwen3Parser, False, "plain answer</think>", "", "plain answer</think>"),
    (Qwen3Parser, False, "<thin", "", "<thin"),
    (Qwen3Parser, False, "x <think>y</think>", "", "x <think>y</think>"),
    (Qwen3Parser, True, "thinking-2507 style</think>answer", "thinking-2507 style", "answer"),
]


@pytest.mark.parametrize(("cls", "inside", "text", "reasoning", "content"), CASES)
def test_split_is_the_same_however_the_text_is_cut(
    cls: type[ReasoningParser], inside: bool, text: str, reasoning: str, content: str
) -> None:
    assert cls(inside).parse(text) == ReasoningDelta(reasoning, content)
    for pieces in cuts(text):
        parser, out = cls(inside), ReasoningDelta()
        for piece in pieces:
            out.extend(parser.feed(piece))
        out.extend(parser.finish())
        assert out == ReasoningDelta(reasoning, content), pieces


def test_the_tag_is_held_back_only_while_it_may_complete() -> None:
    parser = DeepSeekR1Parser(True)
    assert parser.feed("abc </th") == ReasoningDelta("abc ", "")
    assert parser.feed("ink>x") == ReasoningDelta("", "x")
    parser = Qwen3Parser(False)
    assert parser.feed("<thi") == ReasoningDelta()
    assert parser.feed("s is not it") == ReasoningDelta("", "<this is not it")


@pytest.mark.parametrize(
    ("cls", "tail", "kwargs", "inside"),
    [
        (DeepSeekR1Parser, "<｜Assistant｜>", {}, True),  # R1: implicit
        (DeepSeekR1Parser, "<｜Assistant｜>", {"thinking": False}, False),
        (DeepSeekR1Parser, "<｜Assistant｜>", {"enable_thinking": False}, False),
        (Qwen3Parser, "<|im_start|>assistant\n", {}, False),
        (Qwen3Parser, "<|im_start|>assistant\n<think>\n", {}, True),  # the prompt opened it
        (Qwen3Parser, "<think>\n\n</think>\n\n", {"enable_thinking": False}, False),
    ],
)
def test_where_the_block_starts(
    cls: type[ReasoningParser], tail: str, kwargs: dict[str, bool], inside: bool
) -> None:
    assert cls.starts_inside(tail, kwargs) is inside


def test_registry() -> None:
    assert reasoning_parser_class("qwen3") is Qwen3Parser
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser_class("o1")


def count(tokenizer: PreTrainedTokenizerBase, parser: ReasoningParser, ids: list[int]) -> int:
    parser.parse(tokenizer.decode(ids))
    return num_reasoning_tokens(parser, ids, lambda x: tokenizer.decode(x))


def test_reasoning_tokens_end_with_the_closing_tag(tokenizer: PreTrainedTokenizerBase) -> None:
    thinking = tokenizer.encode("Let me count them all.", add_special_tokens=False)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    answer = tokenizer.encode("\n\nFour.", add_special_tokens=False)
    assert len(end) == 1  # one added token in this tokenizer...
    ids = thinking + end + answer
    assert count(tokenizer, DeepSeekR1Parser(True), ids) == len(thinking) + 1
    # ...and the same when the model spells the tag in pieces.
    pieces = [t for part in ("</", "think", ">") for t in tokenizer.encode(part)]
    ids = thinking + pieces + answer
    assert count(tokenizer, DeepSeekR1Parser(True), ids) == len(thinking) + len(pieces)
    # Never closed: all of it; no block at all: none.
    assert count(tokenizer, DeepSeekR1Parser(True), thinking) == len(thinking)
    assert count(tokenizer, Qwen3Parser(False), thinking + end + answer) == 0
