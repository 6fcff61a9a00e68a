"""The messages between the three calls of a step: ``Scheduler.schedule`` returns a
``SchedulerOutput``, ``StepExecutor.execute`` runs it and returns an ``ExecuteOutput``,
``Scheduler.commit`` applies both to the requests (vLLM's ``SchedulerOutput`` and
``ModelRunnerOutput``).

The plan holds host lists and the requests, no tensors. With overlap scheduling it is
executed on the forward worker while the engine thread goes on (overlap.py), so nothing
``execute`` reads of it may change meanwhile: the slot lists are copies then, and a decode
whose input is the token the step before is still sampling carries a placeholder
(``pending_token``) that ``forward_plan`` fills from that step's sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.scheduler.core.req import Req
from services.scheduler.model_executor.model_runner import ForwardPlan
from services.scheduler.model_executor.pooling import PoolSpan
from services.scheduler.sampling.prompt_logprobs import PromptLogprob, PromptSpan
from services.scheduler.sampling.sampler import SampleOutput


def pending_token(row: int) -> int:
    """The input of a decode whose token is row ``row`` of the in-flight step's sample
    (negative: no vocabulary id is); ``forward_plan`` puts the sampled token in its place."""
    return -1 - row


@dataclass(slots=True)
class SchedulerOutput:
    """One step as scheduled. Request ``i`` feeds ``new_token_ids[i]`` at positions
    ``prefix_lens[i]`` onwards; the ``*_rows`` lists index ``reqs``."""

    max_num_tokens: int  # the step's token budget
    reqs: list[Req] = field(default_factory=list)  # the requests the forward runs, in order
    new_token_ids: list[list[int]] = field(default_factory=list)  # negative: a placeholder
    prefix_lens: list[int] = field(default_factory=list)  # tokens already in KV before the step
    # Every pool slot of each request, cached prefix then new tokens; set once scheduling
    # is done (the requests' live lists, or copies of them for the forward worker).
    kv_slots: list[list[int]] = field(default_factory=list)
    num_tokens: int = 0  # new tokens in all
    prompt_rows: list[int] = field(default_factory=list)  # chunks of a prompt: cached once done
    sample_rows: list[int] = field(default_factory=list)  # each samples its next token
    prompt_only_rows: list[int] = field(default_factory=list)  # prompt done, nothing to sample
    # Finished session requests whose last token only gets its K/V (sessions.py). They are
    # scheduled first: rows ``0 .. len(kv_only_rows) - 1``.
    kv_only_rows: list[int] = field(default_factory=list)
    prompt_spans: list[PromptSpan] = field(default_factory=list)  # prompt rows to score
    pool_spans: list[PoolSpan] = field(default_factory=list)  # prompt rows to pool
    has_placeholders: bool = False  # some input is a token the step before is sampling

    @property
    def budget(self) -> int:
        """Tokens the step may still take."""
        return self.max_num_tokens - self.num_tokens

    def forward_plan(self, inflight_tokens: list[int] | None = None) -> ForwardPlan:
        """What the model runner needs of this step; ``inflight_tokens`` (the sample of the
        step before) fill the placeholders."""
        new_token_ids = self.new_token_ids
        if self.has_placeholders:
            if inflight_tokens is None:
                raise ValueError("a step with placeholders needs the in-flight step's tokens")
            new_token_ids = [
                [inflight_tokens[-1 - t] if t < 0 else t for t in chunk] for chunk in new_token_ids
            ]
        return ForwardPlan(
            new_token_ids,
            self.prefix_lens,
            self.kv_slots,
            self.sample_rows,
            self.prompt_spans,
            [req.rope_len or len(req.input_ids) for req in self.reqs],
            self.pool_spans,
        )


@dataclass(frozen=True, slots=True)
class ExecuteOutput:
    """What executing a step gave, in the order its ``SchedulerOutput`` lists them."""

    sampled: SampleOutput  # one token per ``sample_rows`` entry
    prompt_logprobs: list[list[PromptLogprob]]  # per ``prompt_spans`` entry
    pooled: list[torch.Tensor]  # per ``pool_spans`` entry: the float32 row sum
