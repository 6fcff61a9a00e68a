"""The scheduler core: continuous batching over a KV pool, no transport.

``Scheduler.step()`` runs one engine step: schedule, forward, sample, check
stops, free what finished, and return the rows to send downstream. It is
single-threaded by contract (the engine thread owns it); tests call it directly.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.kv_pool import KVPool
from services.scheduler.req import FinishInfo, Req, ReqStatus
from services.scheduler.sampler import Sampler
from services.scheduler.stop_checker import StopChecker

logger = logging.getLogger(__name__)


class CausalLM(Protocol):
    def forward(self, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_waiting_requests: int = 4096
    max_num_batched_tokens: int = 1024  # per step: prefill chunk tokens + one per decode
    context_length: int = 4096


@dataclass(slots=True)
class OutputRow:
    """What one request produced in one step (domain twin of TokenIDRow)."""

    req: Req
    new_token_ids: list[int]
    finish: FinishInfo | None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    reqs: list[Req]
    chunks: list[list[int]]  # new tokens fed per request
    samples: list[bool]  # whether the request reaches its end and samples


class Scheduler:
    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        stop_checker: StopChecker,
        config: SchedulerConfig,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.stop_checker = stop_checker
        self.config = config
        self.device = device
        self.sampler = Sampler(device)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self._aborted_rows: list[OutputRow] = []
        self.num_steps = 0

    # ---- requests in and out -------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Queue a request; ALREADY_EXISTS while a request with its rid is live."""
        if req.rid in self.reqs:
            raise AlreadyExistsError(f"request id {req.rid!r} is already in flight", field="rid")
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise ResourceExhaustedError("scheduler waiting queue is full")
        if len(req.input_ids) + 1 > min(self.config.context_length, self.kv_pool.num_tokens):
            raise InvalidArgumentError(
                f"prompt of {len(req.input_ids)} tokens does not fit the context", field="prompt"
            )
        if req.params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(req.params.seed)
        req.times.setdefault("scheduled", time.time())
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str, reason: str = "aborted") -> bool:
        """Free the request's KV and slot now; emits a final ``abort`` row. Idempotent."""
        req = self.reqs.get(rid)
        if req is None or req.is_finished:
            return False
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._finish(req, FinishInfo("abort", message=reason), ReqStatus.ABORTED)
        self._aborted_rows.append(OutputRow(req, [], req.finish))
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborted_rows)

    # ---- one step --------------------------------------------------------------

    def step(self) -> list[OutputRow]:
        rows, self._aborted_rows = self._aborted_rows, []
        plan = self._schedule()
        if plan.reqs:
            rows.extend(self._run(plan))
            self.num_steps += 1
        return rows

    def _schedule(self) -> StepPlan:
        plan = StepPlan([], [], [])
        budget = self.config.max_num_batched_tokens
        # Decodes first: they hold KV already and each needs one token of budget.
        for req in sorted(self.running, key=lambda r: r.num_uncomputed):
            if budget <= 0:
                break
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted earlier in this loop
            n = min(req.num_uncomputed, budget)
            while not self.kv_pool.can_allocate(n) and self._retract_one(keep=[*plan.reqs, req]):
                pass
            if not self.kv_pool.can_allocate(n):
                break
            self._plan_chunk(plan, req, n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            n = min(req.num_uncomputed, budget)
            if not self.kv_pool.can_allocate(n):
                break
            self.waiting.popleft()
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            self._plan_chunk(plan, req, n)
            budget -= n
        return plan

    def _plan_chunk(self, plan: StepPlan, req: Req, n: int) -> None:
        start = req.num_computed
        plan.reqs.append(req)
        plan.chunks.append(req.fill_ids[start : start + n])
        plan.samples.append(start + n == len(req.input_ids) + len(req.output_ids))

    def _retract_one(self, keep: list[Req]) -> bool:
        """Preempt the newest running request not in ``keep`` back to the queue front."""
        for victim in reversed(self.running):
            if all(victim is not k for k in keep):
                self.running.remove(victim)
                self.kv_pool.free(victim.kv_slots)
                victim.kv_slots = []
                victim.status = ReqStatus.WAITING
                self.waiting.appendleft(victim)
                logger.info("retracted rid=%s to free KV", victim.rid)
                return True
        return False

    def _run(self, plan: StepPlan) -> list[OutputRow]:
        prefix_lens = [r.num_computed for r in plan.reqs]
        for req, chunk in zip(plan.reqs, plan.chunks, strict=True):
            req.kv_slots.extend(self.kv_pool.allocate(len(chunk)))
        batch = ForwardBatch.build(
            plan.chunks, prefix_lens, [r.kv_slots for r in plan.reqs], self.device
        )
        logits = self.model.forward(batch, self.kv_pool)
        rows_idx = [i for i, s in enumerate(plan.samples) if s]
        if not rows_idx:
            return []
        sampling_reqs = [plan.reqs[i] for i in rows_idx]
        tokens, logprobs = self.sampler.sample(
            logits[rows_idx],
            [r.params for r in sampling_reqs],
            [r.generator for r in sampling_reqs],
        )
        return self._commit(sampling_reqs, tokens.tolist(), logprobs)

    def _commit(
        self, reqs: list[Req], tokens: list[int], logprobs: torch.Tensor
    ) -> list[OutputRow]:
        rows = []
        now = time.time()
        for i, (req, token) in enumerate(zip(reqs, tokens, strict=True)):
            req.output_ids.append(token)
            req.times.setdefault("first_token", now)
            entry = self._logprob_entry(req, token, logprobs[i]) if req.return_logprob else None
            finish = self.stop_checker.check(req)
            if finish is not None:
                self.running.remove(req)
                self._finish(req, finish, ReqStatus.FINISHED)
            rows.append(OutputRow(req, [token], finish, [entry] if entry else []))
        return rows

    @staticmethod
    def _logprob_entry(
        req: Req, token: int, row: torch.Tensor
    ) -> tuple[int, float, list[tuple[int, float]]]:
        top: list[tuple[int, float]] = []
        if req.top_logprobs_num > 0:
            values, ids = torch.topk(row, req.top_logprobs_num)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return token, float(row[token]), top

    def _finish(self, req: Req, finish: FinishInfo, status: ReqStatus) -> None:
        """The one place a request's KV and table entry are released."""
        req.finish = finish
        req.status = status
        req.times["finished"] = time.time()
        self.kv_pool.free(req.kv_slots)
        req.kv_slots = []
        self.reqs.pop(req.rid, None)
