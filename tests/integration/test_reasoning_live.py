"""Reasoning through the real stack and the openai SDK (frontend ``--reasoning-parser
deepseek_r1``), with the scheduler batching streamed rows (``--stream-interval 3``) and
chaining decode steps (``--overlap-schedule``), so both run in a live engine process.

The random default model never writes ``</think>`` by itself, so a ``logit_bias`` on its
id (128822, an ordinary token of the DeepSeek vocabulary) makes it appear at a seed-
dependent place. Where it landed is read from the response's own logprobs (tokens and
their bytes), and the split is checked against that: reasoning is the text before the
first ``</think>``, content the text after it, ``reasoning_tokens`` counts up to and
including it; the streamed deltas, cut every three tokens, add up to the same split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.live_stack import module_stack

THINK_END_ID = "128822"
SEEDS = range(4)
BUDGET = 24
MESSAGES = [{"role": "user", "content": "Think it over, then answer."}]


stack = module_stack(
    "reasoning-logs",
    scheduler_args=["--kv-cache-tokens", "8192", "--num-threads", "1", "--stream-interval", "3"]
    + ["--overlap-schedule"],
    frontend_args=["--reasoning-parser", "deepseek_r1"],
)


def ask(client: openai.OpenAI, model_id: str, seed: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=model_id,
        messages=MESSAGES,
        max_tokens=BUDGET,
        seed=seed,
        logit_bias={THINK_END_ID: 25},
        **kwargs,
    )


@pytest.fixture(scope="module")
def special_tokens(default_model_dir: Path) -> set[str]:
    """What the text leaves out (``skip_special_tokens`` is on by default), though the
    logprobs list it: a random model writes such tokens now and then."""
    added = AutoTokenizer.from_pretrained(default_model_dir).added_tokens_decoder
    return {token.content for token in added.values() if token.special}


def text_of(entries: list[Any], special: set[str]) -> str:
    kept = (bytes(e.bytes) for e in entries if e.token not in special)
    return b"".join(kept).decode("utf-8", errors="replace")


def extra(message: Any, name: str) -> Any:
    return (message.model_extra or {}).get(name)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_split_is_where_the_model_wrote_think_end(
    client: openai.OpenAI, model_id: str, seed: int, special_tokens: set[str]
) -> None:
    response = ask(client, model_id, seed, logprobs=True)
    choice = response.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == response.usage.completion_tokens
    tokens = [e.token for e in entries]
    reasoning = extra(choice.message, "reasoning_content")
    assert extra(choice.message, "reasoning") == reasoning  # vLLM's newer name
    num_reasoning = response.usage.completion_tokens_details.reasoning_tokens
    if "</think>" not in tokens:  # the block never closed: all of it is reasoning
        assert reasoning == text_of(entries, special_tokens)
        assert not choice.message.content
        assert num_reasoning == len(entries)
        return
    end = tokens.index("</think>")
    assert (reasoning or "") == text_of(entries[:end], special_tokens)
    assert (choice.message.content or "") == text_of(entries[end + 1 :], special_tokens)
    assert num_reasoning == end + 1


# Lower-case words, the end of the block, more words: the grammar decides where ``</think>``
# may stand, and a bias no logit of the random model can outweigh (its logits span about
# +-40) makes the one token, not its pieces, fill that place. Nothing is left to rounding.
MID_OUTPUT = {"regex": "[a-z]{2,8}</think>[a-z]{2,8}"}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_forced_end_of_block_splits_mid_output(
    client: openai.OpenAI, model_id: str, seed: int, special_tokens: set[str]
) -> None:
    """The split lands inside the output, not only at its edges."""
    response = client.chat.completions.create(
        model=model_id,
        messages=MESSAGES,
        max_tokens=BUDGET,
        seed=seed,
        logit_bias={THINK_END_ID: 100},
        logprobs=True,
        extra_body={"structured_outputs": MID_OUTPUT},
    )
    choice = response.choices[0]
    tokens = [e.token for e in choice.logprobs.content]
    place = tokens.index("</think>")
    assert 0 < place < len(tokens) - 1, tokens
    entries = choice.logprobs.content
    assert extra(choice.message, "reasoning_content") == text_of(entries[:place], special_tokens)
    assert choice.message.content == text_of(entries[place + 1 :], special_tokens)


@pytest.mark.parametrize("seed", SEEDS)
def test_streamed_deltas_add_up_to_the_unary_split(
    client: openai.OpenAI, model_id: str, seed: int
) -> None:
    whole = ask(client, model_id, seed)
    chunks = list(ask(client, model_id, seed, stream=True, stream_options={"include_usage": True}))
    reasoning = "".join(
        extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    message = whole.choices[0].message
    assert reasoning == (extra(message, "reasoning_content") or "")
    assert content == (message.content or "")
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    details = whole.usage.completion_tokens_details
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_thinking_turned_off_makes_everything_content(
    client: openai.OpenAI, model_id: str, special_tokens: set[str]
) -> None:
    response = ask(
        client,
        model_id,
        1,
        logprobs=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = response.choices[0]
    assert extra(choice.message, "reasoning_content") is None
    assert choice.message.content == text_of(choice.logprobs.content, special_tokens)
    assert response.usage.completion_tokens_details.reasoning_tokens == 0
