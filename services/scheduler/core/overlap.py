"""Overlap scheduling: step N+1 is planned and launched before step N is committed.

As in SGLang's overlap scheduler and vLLM's async scheduling, a forward worker thread
runs the forward and the sampler of one step while the engine thread commits the step
before it (stop checks, output rows, what the engine loop then emits and reads) and
plans the next. A decode in the next step feeds the token the in-flight step is still
sampling, so the plan carries a placeholder (``pending_token``) that the worker fills
from the previous job's tokens before it builds the batch: the engine thread never waits
for a token to plan. A request that turns out to have finished in step N has already
been planned into N+1; its extra row is computed and dropped, as in the peers.

Only decode steps of plain requests chain. Whatever needs a committed step first is
run the synchronous way after the in-flight step is committed: admitting or prefilling
prompts (their prefix goes into the radix cache once computed), retracting for room,
grammars and penalties (per-token state the sampler reads), min_tokens still pending,
prompt logprobs and sessions.

The worker is the only thread that runs the model and the sampler while a step is in
flight, and it runs jobs in submission order, so every K/V write happens in plan order:
a slot freed by a commit and handed to a later plan is written only after the in-flight
step that may still read it. It gets copies of the slot lists, and of each ``Req`` it
reads only what a chaining request never changes (its parameters, its generator, which
only the worker draws from then, and nothing that grows per token: ``can_chain``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from services.scheduler.core.req import Req
from services.scheduler.model_executor.model_runner import ForwardPlan, ModelRunner
from services.scheduler.sampling.logits_processor import has_penalties
from services.scheduler.sampling.sampler import SampleOutput, Sampler


def pending_token(row: int) -> int:
    """The input of a decode whose token is row ``row`` of the in-flight step's sample
    (negative: no vocabulary id is); the worker puts the sampled token in its place."""
    return -1 - row


@dataclass(slots=True)
class InflightStep:
    """A launched step: its requests (each samples one token, in row order), the row of
    each rid, and the sample to come."""

    reqs: list[Req]
    rows: dict[str, int]
    future: Future[SampleOutput]


def can_chain(req: Req) -> bool:
    """Whether the next token of ``req`` may be planned before its previous one is committed:
    nothing its sampling or scheduling reads changes when a token is committed."""
    return (
        req.grammar is None
        and req.penalties is None
        and not has_penalties(req.params)
        and len(req.output_ids) >= req.params.min_new_tokens
        and req.prompt_logprobs is None
        and req.session is None
    )


class ForwardWorker:
    """One thread that runs a step's forward and sampling, jobs strictly in order."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner = runner
        self.sampler = sampler
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    def submit(
        self, plan: ForwardPlan, reqs: list[Req], previous: InflightStep | None
    ) -> Future[SampleOutput]:
        """Run ``plan`` and sample ``reqs`` from its logits; pending inputs take the tokens
        ``previous`` sampled."""
        return self._executor.submit(self._run, plan, reqs, previous)

    @torch.inference_mode()
    def _run(
        self, plan: ForwardPlan, reqs: list[Req], previous: InflightStep | None
    ) -> SampleOutput:
        if previous is not None:
            plan = _resolve(plan, previous)
        logits = self.runner.forward(plan)
        return self.sampler.sample(logits, reqs)


def _resolve(plan: ForwardPlan, previous: InflightStep) -> ForwardPlan:
    """``plan`` with each pending input replaced by the token ``previous`` sampled for it.
    Runs on the worker after ``previous`` ran there (jobs run in order): it is done."""
    sampled = previous.future.result().token_ids
    new_token_ids = [
        [sampled[-1 - token] if token < 0 else token for token in chunk]
        for chunk in plan.new_token_ids
    ]
    return replace(plan, new_token_ids=new_token_ids)
