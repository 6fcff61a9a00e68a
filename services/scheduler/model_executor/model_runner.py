"""The model runner: one forward step, from the scheduler's host-side plan to logits.

Owns everything between "what to run" and "what to sample from": the model, the
attention backend's per-step plan, every device tensor of a step (the ``ForwardBatch``
built from plain lists, the row index that picks the sampled tokens) and writing the
step's K/V into the pool slots it is handed. It owns no KV slot (the scheduler
allocates and frees them), no request state and no sampling policy.

One call per step, ``forward(plan) -> logits``, is the seam CUDA graphs (capture the
forward over static buffers) and overlap scheduling (launch step N+1's forward while
step N is committed) hang on: the scheduler never touches a device tensor of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

import torch

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.pooling import PoolSpan, pool_rows
from services.scheduler.model_executor.slot_mirror import SlotMirror
from services.scheduler.sampling.prompt_logprobs import PromptLogprob, PromptSpan, score_rows


class CausalLM(Protocol):
    """What the runner needs of a model: its backend (the kernel its layers call, chosen
    at load), hidden states for a planned batch, and the LM head."""

    config: ModelConfig
    attn_backend: AttentionBackend

    def hidden_states(
        self, batch: ForwardBatch, meta: AttentionMetadata, kv_pool: KVPool
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """One step as the scheduler decided it: host lists only, no tensors, no ``Req``.

    Request ``i`` feeds ``new_token_ids[i]`` at positions ``prefix_lens[i]`` onwards.
    """

    new_token_ids: list[list[int]]  # per request: the tokens this step computes
    prefix_lens: list[int]  # per request: tokens already in KV (first new position)
    kv_slots: list[list[int]]  # per request: every pool slot, cached prefix then new tokens
    logit_rows: list[int]  # requests whose last new token is sampled, in batch order
    prompt_spans: list[PromptSpan] = field(default_factory=list)  # rows to score
    prompt_lens: list[int] = field(default_factory=list)  # per request; empty = unknown
    pool_spans: list[PoolSpan] = field(default_factory=list)  # rows to pool (embeddings)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.new_token_ids))


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [len(plan.logit_rows), vocab] model dtype, see ``ModelRunner.forward``
    prompt_logprobs: list[list[PromptLogprob]]  # per plan.prompt_spans entry
    # per plan.pool_spans entry: its final-norm hidden rows summed, float32 [hidden]
    pooled: list[torch.Tensor] = field(default_factory=list)


class ModelRunner:
    """Runs planned steps of one model over one KV pool on one device.

    Engine thread only. Writes K/V only at the new tokens' slots (``plan.kv_slots`` past
    each prefix) and reads only the planned requests' slots.
    """

    def __init__(self, model: CausalLM, kv_pool: KVPool, device: torch.device | str) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = torch.device(device)
        self.attn_backend = model.attn_backend
        self.slot_mirror = SlotMirror(self.device)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def forward(self, plan: ForwardPlan) -> torch.Tensor:
        """Logits [len(plan.logit_rows), vocab] in the model's dtype (the sampler converts
        what needs float32): row j belongs to request ``plan.logit_rows[j]`` and is the
        model's output at its last new token.

        The LM head runs on those rows only; a step that samples nothing (a prompt chunk
        that does not finish its prompt) still computes and stores its K/V.
        """
        return self.run(plan).logits

    @torch.inference_mode()
    def run(self, plan: ForwardPlan) -> ForwardOutput:
        """``forward``'s logits, the prompt logprobs of each of ``plan.prompt_spans``
        (host values, in span order) and the row sums of each of ``plan.pool_spans``
        (device tensors, in span order), all from the same hidden states."""
        batch = ForwardBatch.build(
            plan.new_token_ids,
            plan.prefix_lens,
            plan.kv_slots,
            self.device,
            prompt_lens=plan.prompt_lens or None,
            slot_mirror=self.slot_mirror,
        )
        meta = self.attn_backend.plan(batch)  # once per step, shared by every layer
        hidden = self.model.hidden_states(batch, meta, self.kv_pool)
        scored = self._score_prompts(hidden, plan) if plan.prompt_spans else []
        pooled = pool_rows(hidden, self._starts(plan), plan.pool_spans) if plan.pool_spans else []
        if not plan.logit_rows:
            empty = torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
            return ForwardOutput(empty, scored, pooled)
        logits = self.model.compute_logits(self._select(hidden, plan))
        return ForwardOutput(logits, scored, pooled)

    @staticmethod
    def _starts(plan: ForwardPlan) -> list[int]:
        """Each request's first row in the step's hidden states."""
        return [0, *accumulate(map(len, plan.new_token_ids))]

    def _score_prompts(self, hidden: torch.Tensor, plan: ForwardPlan) -> list[list[PromptLogprob]]:
        starts = self._starts(plan)
        out = []
        for span in plan.prompt_spans:
            first = starts[span.req_index] + span.first_row
            rows = hidden[first : first + len(span.target_ids)]
            out.append(score_rows(rows, self.model.compute_logits, span.target_ids, span.num_top))
        return out

    def _select(self, hidden: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
        """The hidden rows of each sampled request's last new token; ``hidden`` itself when
        that is every row (a decode step where all requests sample: no gather)."""
        ends = list(accumulate(map(len, plan.new_token_ids)))
        rows = [ends[i] - 1 for i in plan.logit_rows]
        if rows == list(range(hidden.shape[0])):
            return hidden
        return hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)]
