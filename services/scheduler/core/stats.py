"""What the engine counts, as plain data: the metrics layer turns it into Prometheus.

``SchedulerStats`` is the one owner of every count the scheduler keeps (steps, tokens,
prefix-cache lookups, retractions, latency samples, finished requests). The scheduler
adds to it as requests move and hands it over after each step
(``Scheduler.take_stats``), so the hot loop never touches a metrics library and tests
can read exact counts without a registry. Running totals live in the Prometheus
counters, not here. Gauges (queue lengths, KV use) are not counts: they are read from
their owners into ``EngineStats``.

Latencies come from the request's wall-clock stamps (``ReqTimes``): ``queued``
when the scheduler accepted it, ``scheduled`` at its first forward batch,
``first_token`` and ``finished``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.core.req import Req


@dataclass(frozen=True, slots=True)
class FinishedReqStats:
    """One request that left the scheduler; ``None`` for a stage it never reached."""

    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_s: float
    queue_s: float | None
    prefill_s: float | None
    decode_s: float | None

    @classmethod
    def of(cls, req: Req) -> FinishedReqStats:
        assert req.finish is not None, "stats of a request that has not finished"
        t = req.times
        queued, scheduled, first, finished = t.queued, t.scheduled, t.first_token, t.finished
        assert queued is not None and finished is not None, "a request left without its stamps"
        return cls(
            finish_reason=req.finish.kind,
            num_prompt_tokens=len(req.input_ids),
            num_generation_tokens=len(req.output_ids),
            e2e_s=finished - queued,
            queue_s=_span(queued, scheduled),
            prefill_s=_span(scheduled, first),
            decode_s=_span(first, finished),
        )


@dataclass(slots=True)
class SchedulerStats:
    """Everything counted since the last hand-over."""

    num_prompt_tokens: int = 0  # whole prompts, counted when their first token is sampled
    num_generation_tokens: int = 0
    num_prefix_cache_queries: int = 0  # prompt tokens looked up at first admission
    num_prefix_cache_hits: int = 0  # of those, tokens found in the radix cache
    num_retractions: int = 0  # running requests sent back to waiting to free KV
    step_tokens: list[int] = field(default_factory=list)  # tokens each forward computed
    time_to_first_token_s: list[float] = field(default_factory=list)
    inter_token_latency_s: list[float] = field(default_factory=list)
    finished: list[FinishedReqStats] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        """Forward steps run: each adds one ``step_tokens`` entry."""
        return len(self.step_tokens)

    def on_token(self, req: Req, now: float) -> None:
        """``req`` just got a sampled token; ``req.last_token_time`` is still the previous one's."""
        self.num_generation_tokens += 1
        if req.last_token_time is None:
            assert req.times.queued is not None, "a token for a request never queued"
            self.num_prompt_tokens += len(req.input_ids)
            self.time_to_first_token_s.append(now - req.times.queued)
        else:
            self.inter_token_latency_s.append(now - req.last_token_time)


def _span(start: float | None, end: float | None) -> float | None:
    return end - start if start and end else None
