"""What one engine step reports per request: ``OutputRow`` (the domain twin of
``TokenIDRow``), with ``RowInit`` on a request's first row.

Rows are snapshots made on the engine thread that share nothing mutable with the live
``Req``: the transport reads them (or encodes them for the gRPC process) while the
engine steps on, and nobody writes to one once made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.scheduler.core.req import DecodeFlags, FinishInfo, Req, ReqTimes
from services.scheduler.sampling.prompt_logprobs import PromptLogprob
from services.scheduler.sampling.sampler import LogprobEntry

# Prompt tokens sent with a request's first row so the detokenizer can seed its window
# (a leading-space or byte-fallback token decodes differently without context).
PROMPT_TAIL_TOKENS = 5


@dataclass(frozen=True, slots=True)
class RowInit:
    """What the detokenizer needs to start decoding a request: on its first row only."""

    flags: DecodeFlags
    prompt_tail_ids: tuple[int, ...]


@dataclass(slots=True)
class OutputRow:
    """What one request produced in one step (domain twin of TokenIDRow).

    A snapshot made on the engine thread that shares nothing mutable with the live
    ``Req``. Not frozen, though nothing writes to it: the gRPC process rebuilds every row
    of every step from the engine process's pipe, and a frozen dataclass's ``__init__``
    sets each field through ``object.__setattr__``, about five times the cost
    (docs/benchmarks.md#the-engine-pipes-codec).
    """

    rid: str
    new_token_ids: tuple[int, ...]
    finish: FinishInfo | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: tuple[LogprobEntry, ...] = ()
    times: ReqTimes | None = None  # a copy of the request's stage stamps, on its final row
    init: RowInit | None = None
    # Every prompt logprob, on the first row made once the whole prompt is scored.
    input_logprobs: tuple[PromptLogprob, ...] = ()
    # A pooling request's result, on its only row: the pooled hidden state.
    embedding: tuple[float, ...] = ()

    @classmethod
    def of(
        cls,
        req: Req,
        new_token_ids: Sequence[int],
        finish: FinishInfo | None,
        logprobs: Sequence[LogprobEntry] = (),
        embedding: tuple[float, ...] = (),
    ) -> OutputRow:
        """Snapshot ``req`` now; the first row of a request carries its ``RowInit``.
        Engine thread only: it marks ``req.sent_init``."""
        init = None
        if not req.sent_init:
            req.sent_init = True
            init = RowInit(req.flags, tuple(req.input_ids[-PROMPT_TAIL_TOKENS:]))
        return cls(
            rid=req.rid,
            new_token_ids=tuple(new_token_ids),
            finish=finish,
            num_prompt_tokens=len(req.input_ids),
            num_output_tokens=len(req.output_ids),
            num_cached_tokens=req.num_cached_tokens,
            logprobs=tuple(logprobs),
            times=replace(req.times) if finish is not None else None,
            init=init,
            input_logprobs=(
                req.prompt_logprobs.take(len(req.input_ids)) if req.prompt_logprobs else ()
            ),
            embedding=embedding,
        )
