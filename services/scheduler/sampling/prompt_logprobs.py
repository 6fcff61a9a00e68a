"""Prompt logprobs: for each prompt position p >= start, log P(input_ids[p] | input_ids[:p]).

Gathered chunk by chunk while a prompt is prefilled. The logits at position q score the
token at q + 1, so a chunk that computes positions [a, b) scores tokens a + 1 .. b. Per
position only what is asked survives the step (the token's logprob, its rank, the top-N);
the LM head runs over ``ROWS_PER_PASS`` rows at a time, so no [prompt_len, vocab] tensor
ever exists (129,280 float32 columns are 0.5 MB a row).

Values are the raw model distribution, ``log_softmax`` of the logits, before any
temperature, penalty or bias (what vLLM documents for prompt logprobs).

Positions whose KV comes from the prefix cache have no logits, so a request still
gathering prompt logprobs reuses cached KV only up to the first position whose logits it
needs (``PromptLogprobState.max_prefix_len``). Entries stay on the request until its
first row: a retracted request resumes from ``next_pos``, repeating and losing none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.common.errors import InvalidArgumentError

ROWS_PER_PASS = 256
"""Hidden rows per LM-head pass: bounds a pass's logits to 256 x vocab float32."""
MAX_NUM_TOP = 20
"""Alternatives per prompt position (vLLM's default max_logprobs, the frontend's bound):
a prompt's entries are host objects, so their count must stay bounded."""


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """One prompt position: its token, that token's logprob and rank, the top-N."""

    token_id: int
    logprob: float | None  # None: the first prompt token, which nothing precedes
    rank: int  # 1 + tokens scored strictly higher; 0 where logprob is None
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Rows of one step's batch to score: request ``req_index``'s new tokens from
    ``first_row`` on, one per target (the prompt token each row's logits predict)."""

    req_index: int
    first_row: int
    target_ids: list[int]
    num_top: int


@dataclass(slots=True)
class PromptLogprobState:
    """What one request asked for and what it has gathered so far (engine thread only)."""

    start: int  # the first prompt position asked for
    num_top: int
    next_pos: int  # the first prompt position not scored yet
    entries: list[PromptLogprob] = field(default_factory=list)
    is_sent: bool = False

    @classmethod
    def create(cls, input_ids: Sequence[int], start: int, num_top: int) -> PromptLogprobState:
        """From ``start``; ``validate`` checks it against the prompt."""
        state = cls(start=start, num_top=num_top, next_pos=max(start, 1))
        if start == 0 and input_ids:
            state.entries.append(PromptLogprob(input_ids[0], None, 0))
        return state

    def validate(self, num_prompt: int) -> None:
        """INVALID_ARGUMENT naming the field unless a prompt of ``num_prompt`` tokens
        can be scored as asked."""
        if not 0 <= self.start < num_prompt:
            raise InvalidArgumentError(
                f"must be in [0, {num_prompt}) for this prompt, got {self.start}",
                field="logprob_start_len",
            )
        if not 0 <= self.num_top <= MAX_NUM_TOP:
            raise InvalidArgumentError(
                f"must be in [0, {MAX_NUM_TOP}], got {self.num_top}",
                field="prompt_top_logprobs_num",
            )

    def is_done(self, num_prompt: int) -> bool:
        return self.next_pos >= num_prompt

    def max_prefix_len(self, num_prompt: int) -> int | None:
        """How much cached KV the request may reuse: up to the position whose logits
        score ``next_pos``; None (no limit) once every prompt position is scored."""
        return None if self.is_done(num_prompt) else self.next_pos - 1

    def span(
        self, req_index: int, input_ids: Sequence[int], prefix_len: int, num_new: int
    ) -> PromptSpan | None:
        """The rows of a step that computes positions [prefix_len, prefix_len + num_new)
        still needed here; None when the step scores nothing for this request."""
        first = self.next_pos - 1
        end = min(prefix_len + num_new, len(input_ids) - 1)
        if first >= end:
            return None
        if first < prefix_len:  # max_prefix_len keeps cached KV below ``first``
            raise RuntimeError(f"prompt logprobs from {self.next_pos} after KV from cache")
        targets = list(input_ids[first + 1 : end + 1])
        return PromptSpan(req_index, first - prefix_len, targets, self.num_top)

    def add(self, entries: Sequence[PromptLogprob]) -> None:
        self.entries.extend(entries)
        self.next_pos += len(entries)

    def take(self, num_prompt: int) -> tuple[PromptLogprob, ...]:
        """Every entry, once, when the whole prompt is scored; nothing before or after."""
        if self.is_sent or not self.is_done(num_prompt):
            return ()
        self.is_sent = True
        entries, self.entries = tuple(self.entries), []
        return entries


def score_rows(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    target_ids: Sequence[int],
    num_top: int,
) -> list[PromptLogprob]:
    """Row i of ``hidden`` scores ``target_ids[i]``: its logprob, rank and the top
    ``num_top``, one LM-head pass per ``ROWS_PER_PASS`` rows."""
    targets = torch.tensor(target_ids, dtype=torch.int64, device=hidden.device)
    out: list[PromptLogprob] = []
    for lo in range(0, len(target_ids), ROWS_PER_PASS):
        rows = slice(lo, lo + ROWS_PER_PASS)
        logprobs = torch.log_softmax(compute_logits(hidden[rows]).float(), dim=-1)
        chosen = logprobs.gather(1, targets[rows].unsqueeze(1))
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(ranks)
        if num_top > 0:
            values, ids = logprobs.topk(num_top, dim=-1)
            pairs = zip(ids.tolist(), values.tolist(), strict=True)
            tops = [tuple(zip(i, v, strict=True)) for i, v in pairs]
        for token, value, rank, top in zip(
            target_ids[rows], chosen.squeeze(1).tolist(), ranks, tops, strict=True
        ):
            out.append(PromptLogprob(token, value, rank, top))
    return out


class PromptScoredRequest(Protocol):
    """What span planning reads of a request (the scheduler's ``Req`` is one)."""

    @property
    def input_ids(self) -> list[int]: ...

    @property
    def prompt_logprobs(self) -> PromptLogprobState | None: ...


def plan_spans(
    reqs: Sequence[PromptScoredRequest], prefix_lens: Sequence[int], chunks: Sequence[Sequence[int]]
) -> list[PromptSpan]:
    """The rows one step must score: for each request still gathering prompt logprobs,
    the part of its chunk whose logits score positions it has not scored yet."""
    spans = []
    for i, (req, prefix_len, chunk) in enumerate(zip(reqs, prefix_lens, chunks, strict=True)):
        state = req.prompt_logprobs
        if state is not None and not state.is_done(len(req.input_ids)):
            span = state.span(i, req.input_ids, prefix_len, len(chunk))
            if span is not None:
                spans.append(span)
    return spans


def record_spans(
    reqs: Sequence[PromptScoredRequest],
    spans: Sequence[PromptSpan],
    scored: Sequence[list[PromptLogprob]],
) -> None:
    """Add each span's entries to its request (``plan_spans`` made the spans from it)."""
    for span, entries in zip(spans, scored, strict=True):
        state = reqs[span.req_index].prompt_logprobs
        if state is not None:
            state.add(entries)
