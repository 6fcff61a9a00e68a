"""Prompt logprobs at the frontend: what a client may ask for, and the shapes it gets back.

The scheduler returns one ``TokenLogprob`` per prompt position from the requested start
(the first prompt token has ``no_logprob`` set: nothing precedes it). Three APIs read them:

* vLLM's ``prompt_logprobs: N`` (completions: per choice; chat: on the response, as vLLM
  puts it): every prompt position, N alternatives, each entry and alternative with its
  text (vLLM's ``decoded_token``); the gateway writes vLLM's dicts.
* OpenAI completions ``echo`` with ``logprobs: N``: the prompt's entries lead
  ``choice.logprobs`` (the first one null), then the generated tokens'.
* the native API: ``logprob_start_len`` and ``GenerateOutput.input_token_logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tokenline.v1 import common_pb2

from services.common.errors import InvalidArgumentError

MAX_PROMPT_LOGPROBS = 20
"""vLLM's default ``max_logprobs``: the most alternatives a prompt position may ask for."""


def prompt_logprobs_top(value: int | None, *, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs`` checked: the alternatives per position, None when unset.
    vLLM refuses it on a stream (it has nowhere to go), and so do we, even at 0."""
    if value is None:
        return None
    if not 0 <= value <= MAX_PROMPT_LOGPROBS:
        raise InvalidArgumentError(
            f"must be in [0, {MAX_PROMPT_LOGPROBS}], got {value}", field="prompt_logprobs"
        )
    if stream:
        raise InvalidArgumentError("not available when stream is true", field="prompt_logprobs")
    return value


def check_start_len(start: int | None, prompt_lens: Sequence[int]) -> None:
    """SGLang's ``logprob_start_len`` must name a position of every prompt."""
    if start is None:
        return
    for j, num in enumerate(prompt_lens):
        if not 0 <= start < num:
            raise InvalidArgumentError(
                f"must be in [0, {num}) for prompt {j} of {num} tokens, got {start}",
                field="logprob_start_len",
            )


def with_texts(
    entries: Sequence[common_pb2.TokenLogprob], token_text: Callable[[int], str]
) -> list[common_pb2.TokenLogprob]:
    """Copies of ``entries`` whose token and alternatives carry their text."""
    out = []
    for entry in entries:
        copy = common_pb2.TokenLogprob()
        copy.CopyFrom(entry)
        out.append(copy)
    add_token_texts(out, token_text)
    return out


def add_token_texts(
    entries: Iterable[common_pb2.TokenLogprob], token_text: Callable[[int], str]
) -> None:
    """Give each entry and its alternatives their token's text, in place."""
    for entry in entries:
        entry.text = token_text(entry.token_id)
        for top in entry.top:
            top.text = token_text(top.token_id)
