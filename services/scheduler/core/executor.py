"""The middle call of a step: run a ``SchedulerOutput`` through the model and the sampler.

``StepExecutor`` is the only part of the scheduler core that touches the model runner and
the sampler. It runs on the engine thread, or with overlap scheduling on the forward
worker (overlap.py), one step at a time in submission order either way. Of the requests
it reads only what sampling needs (parameters, generators, penalty and grammar state);
it changes no scheduling state: ``Scheduler.commit`` applies what it returns.
"""

from __future__ import annotations

import torch

from services.scheduler.core.scheduler_output import ExecuteOutput, SchedulerOutput
from services.scheduler.model_executor.model_runner import ModelRunner
from services.scheduler.sampling.sampler import SampleOutput, Sampler


class StepExecutor:
    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner = runner
        self.sampler = sampler

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, inflight_tokens: list[int] | None = None
    ) -> ExecuteOutput:
        """Run the step's forward, then sample its ``sample_rows``; ``inflight_tokens``:
        the sample of the step before, where ``out`` feeds placeholders for it."""
        reqs = [out.reqs[i] for i in out.sample_rows]
        # What the sampler needs beside the logits (grammar bitmasks) is known now: it
        # starts first and builds beside the forward.
        self.sampler.prepare(reqs, self.runner.vocab_size, self.runner.device)
        forward = self.runner.run(out.forward_plan(inflight_tokens))
        sampled = self.sampler.sample(forward.logits, reqs) if reqs else SampleOutput([], [])
        return ExecuteOutput(sampled, forward.prompt_logprobs, forward.pooled)
