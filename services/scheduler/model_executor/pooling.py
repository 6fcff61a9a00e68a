"""Pooling: a prompt's final hidden states (after the model's final norm) as one vector,
what an embedding request gets instead of a sampled token.

Gathered chunk by chunk while the prompt is prefilled, like prompt logprobs: each step
that computes positions a request still needs hands back, per request, the float32 sum
of those rows (``last`` and ``cls`` need one row, so the sum is that row). ``mean``
adds each chunk's sum to the request's running total and divides by the prompt length
once the last chunk is in, so chunked prefill and a prompt computed in one step pool
the same rows (to float32 summation order).

Positions served from the prefix cache have no hidden states, so a request still pooling
reuses cached KV only up to the first position it needs (``max_prefix_len``): ``last``
needs only the last position, which is always computed; ``cls`` needs position 0, so it
reuses nothing until pooled; ``mean`` needs every position. A retracted request keeps its
total and resumes from ``next_pos``, repeating and losing no row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

PoolingMethod = Literal["last", "mean", "cls"]
POOLING_METHODS: tuple[PoolingMethod, ...] = ("last", "mean", "cls")
NORMALIZE_EPS = 1e-12
"""The floor of the norm a vector is divided by (``torch.nn.functional.normalize``'s, as
vLLM and sentence-transformers use): an all-zero state stays zero instead of NaN."""


@dataclass(frozen=True, slots=True)
class PoolSpan:
    """Rows of one step's batch to pool: request ``req_index``'s new tokens
    ``[first_row, first_row + num_rows)``."""

    req_index: int
    first_row: int
    num_rows: int


@dataclass(slots=True)
class PoolingState:
    """What one request asked for and what it has pooled so far (engine thread only)."""

    method: PoolingMethod
    normalize: bool = True
    next_pos: int = 0  # the first prompt position not pooled yet
    total: torch.Tensor | None = None  # float32 [hidden]: the sum of the rows pooled so far

    def wanted(self, num_prompt: int) -> tuple[int, int]:
        """The prompt positions ``[lo, hi)`` this method reads."""
        if self.method == "last":
            return num_prompt - 1, num_prompt
        if self.method == "cls":
            return 0, 1
        return 0, num_prompt

    def is_done(self, num_prompt: int) -> bool:
        return self.next_pos >= self.wanted(num_prompt)[1]

    def max_prefix_len(self, num_prompt: int) -> int | None:
        """How much cached KV the request may reuse: up to the first position it still
        needs; None (no limit) once pooled."""
        if self.is_done(num_prompt):
            return None
        return max(self.wanted(num_prompt)[0], self.next_pos)

    def span(
        self, req_index: int, num_prompt: int, prefix_len: int, num_new: int
    ) -> PoolSpan | None:
        """The rows of a step that computes positions [prefix_len, prefix_len + num_new)
        still needed here; None when the step pools nothing for this request."""
        lo, hi = self.wanted(num_prompt)
        first = max(lo, self.next_pos)
        end = min(hi, prefix_len + num_new)
        if first >= end:
            return None
        if first < prefix_len:  # max_prefix_len keeps cached KV below ``first``
            raise RuntimeError(f"pooling from position {first} after KV from cache")
        return PoolSpan(req_index, first - prefix_len, end - first)

    def add(self, row_sum: torch.Tensor, num_rows: int, num_prompt: int) -> None:
        """Add one span's row sum (the span ``span`` made from this state)."""
        self.total = row_sum if self.total is None else self.total + row_sum
        self.next_pos = max(self.wanted(num_prompt)[0], self.next_pos) + num_rows

    def result(self, num_prompt: int) -> tuple[float, ...]:
        """The pooled vector, normalised when asked; only once every wanted row is in."""
        if self.total is None or not self.is_done(num_prompt):
            raise RuntimeError("pooling result asked before the prompt was computed")
        lo, hi = self.wanted(num_prompt)
        vector = self.total / (hi - lo)
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0, eps=NORMALIZE_EPS)
        return tuple(vector.tolist())


def pool_rows(
    hidden: torch.Tensor, starts: Sequence[int], spans: Sequence[PoolSpan]
) -> list[torch.Tensor]:
    """Each span's rows of ``hidden`` summed in float32 (``starts[i]``: request i's first
    row in the batch); a one-row span is that row."""
    out = []
    for span in spans:
        first = starts[span.req_index] + span.first_row
        out.append(hidden[first : first + span.num_rows].float().sum(dim=0))
    return out


class PooledRequest(Protocol):
    """What span planning reads of a request (the scheduler's ``Req`` is one)."""

    @property
    def input_ids(self) -> list[int]: ...

    @property
    def pooling(self) -> PoolingState | None: ...


def plan_pool_spans(
    reqs: Sequence[PooledRequest], prefix_lens: Sequence[int], chunks: Sequence[Sequence[int]]
) -> list[PoolSpan]:
    """The rows one step must pool: for each request still pooling, the part of its
    chunk at positions it has not pooled yet."""
    spans = []
    for i, (req, prefix_len, chunk) in enumerate(zip(reqs, prefix_lens, chunks, strict=True)):
        state = req.pooling
        if state is not None and not state.is_done(len(req.input_ids)):
            span = state.span(i, len(req.input_ids), prefix_len, len(chunk))
            if span is not None:
                spans.append(span)
    return spans


def record_pool_spans(
    reqs: Sequence[PooledRequest], spans: Sequence[PoolSpan], pooled: Sequence[torch.Tensor]
) -> None:
    """Add each span's row sum to its request (``plan_pool_spans`` made the spans)."""
    for span, row_sum in zip(spans, pooled, strict=True):
        req = reqs[span.req_index]
        if req.pooling is not None:
            req.pooling.add(row_sum, span.num_rows, len(req.input_ids))
