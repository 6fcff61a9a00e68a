"""Overlap scheduling: the three calls of a step, pipelined.

As in SGLang's overlap scheduler and vLLM's async scheduling, a forward worker thread runs
``execute`` (forward and sampling) while the engine thread commits the step before it
(stop checks, output rows, what the engine loop then emits and reads) and schedules the
next. The code is the same as without overlap; only where ``execute`` runs and when
``commit`` follows it differ (``Scheduler.step``): every step is submitted to the worker,
and committed by the next ``step()`` call, after that call has scheduled and submitted its
own step when the two may overlap, before it schedules otherwise.

A decode in the next step feeds the token the in-flight step is still sampling, so the
plan carries a placeholder (``pending_token``) that the worker fills from the previous
step's sample before it builds the batch: the engine thread never waits for a token to
schedule. A request that turns out to have finished in step N has already been scheduled
into N+1; its extra row is computed and dropped, as in the peers.

Only decode steps of plain requests overlap. Whatever needs a committed step first waits
for the in-flight step to be committed before it is scheduled: admitting or prefilling
prompts (their prefix goes into the radix cache once computed), retracting for room,
grammars and penalties (per-token state the sampler reads), min_tokens still pending,
prompt logprobs and sessions.

The worker is the only thread that runs the model and the sampler while a step is in
flight, and it runs jobs in submission order, so every K/V write happens in schedule
order: a slot freed by a commit and handed to a later step is written only after the
in-flight step that may still read it. It gets copies of the slot lists, and of each
``Req`` it reads only what an overlapping request never changes (its parameters, its
generator, which only the worker draws from then, and nothing that grows per token:
``can_chain``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from services.scheduler.core.executor import StepExecutor
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler_output import ExecuteOutput, SchedulerOutput
from services.scheduler.sampling.logits_processor import has_penalties


@dataclass(slots=True)
class InflightStep:
    """A submitted step: its plan, the row of each sampling rid in its sample, the
    result to come, and whether the next step may be scheduled before it is committed
    (only decodes of requests that ``can_chain``)."""

    out: SchedulerOutput
    rows: dict[str, int]
    future: Future[ExecuteOutput]
    is_chainable: bool


def can_chain(req: Req) -> bool:
    """Whether the next token of ``req`` may be scheduled before its previous one is
    committed: nothing its sampling or scheduling reads changes when a token is committed."""
    return (
        req.grammar is None
        and req.penalties is None
        and not has_penalties(req.params)
        and len(req.output_ids) >= req.params.min_new_tokens
        and req.prompt_logprobs is None
        and req.session is None
    )


def is_chainable_step(out: SchedulerOutput) -> bool:
    """Whether the next step may be scheduled on top of ``out``: every request decodes one
    token and samples it, and each ``can_chain``."""
    return all(
        len(chunk) == 1 and prefix_len >= len(req.input_ids) and can_chain(req)
        for req, chunk, prefix_len in zip(out.reqs, out.new_token_ids, out.prefix_lens, strict=True)
    )


class ForwardWorker:
    """One thread that executes steps, strictly in submission order."""

    def __init__(self, executor: StepExecutor) -> None:
        self.executor = executor
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    def submit(
        self, out: SchedulerOutput, previous: Future[ExecuteOutput] | None
    ) -> Future[ExecuteOutput]:
        """Execute ``out``; its placeholders take the tokens ``previous`` sampled."""
        return self._pool.submit(self._run, out, previous)

    def _run(self, out: SchedulerOutput, previous: Future[ExecuteOutput] | None) -> ExecuteOutput:
        tokens = None
        if previous is not None and out.has_placeholders:
            # Submitted before this job on this thread: done (or failed, and so is this).
            tokens = previous.result().sampled.token_ids
        return self.executor.execute(out, tokens)
