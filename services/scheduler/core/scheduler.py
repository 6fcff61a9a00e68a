"""The scheduler core: continuous batching over a KV pool, no transport.

``Scheduler.step()`` runs one engine step: schedule, forward, sample, check
stops, release what finished, and return the rows to send downstream. It is
single-threaded by contract (the engine thread owns it); tests call it directly.
With ``overlap_schedule`` a decode step's forward and sampling run on a forward
worker thread while ``step()`` commits the step before (overlap.py).

Owns the scheduling policy, every ``Req``'s state, KV slot allocation (through
``KVCacheManager``), sampling and stop checks. The forward itself, and every device
tensor it needs, belong to ``ModelRunner``: the scheduler hands it a ``ForwardPlan``
of host lists and gets back the logits of the rows it samples.

Scheduling per step, under a token budget: running requests first (decodes take
one token each; a prompt being prefilled takes a chunk), retracting the
lowest-priority, newest running request when KV runs out; then waiting requests
in priority order, each starting from its longest cached prefix.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from services.common.errors import AlreadyExistsError, ResourceExhaustedError
from services.scheduler.core.messages import EngineLimits, Runner
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.overlap import (
    ForwardWorker,
    InflightStep,
    can_chain,
    pending_token,
)
from services.scheduler.core.req import FinishInfo, Req, ReqStatus
from services.scheduler.core.sessions import SessionManager
from services.scheduler.core.stats import FinishedReqStats, SchedulerStats
from services.scheduler.core.stop_checker import StopChecker
from services.scheduler.core.waiting_queue import WaitingQueue
from services.scheduler.mem_cache.kv_cache import KVCacheManager
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.model_runner import CausalLM, ForwardPlan, ModelRunner
from services.scheduler.model_executor.pooling import (
    PoolSpan,
    plan_pool_spans,
    record_pool_spans,
)
from services.scheduler.sampling.grammar import GrammarCompiler, create_request_grammar
from services.scheduler.sampling.prompt_logprobs import PromptSpan, plan_spans, record_spans
from services.scheduler.sampling.sampler import SampleOutput, Sampler

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_waiting_requests: int = 4096
    max_num_batched_tokens: int = 1024  # per step: prefill chunk tokens + one per decode
    context_length: int = 4096
    enable_prefix_cache: bool = True
    # A streamed request's row goes out with its first token, then once every this many
    # tokens (SGLang's --stream-interval); unary requests send only their final row.
    stream_interval: int = 1
    # Plan and launch the next decode step before committing the one in flight (overlap.py).
    overlap_schedule: bool = False
    # "pooling" (--runner pooling): only pooling requests are served, so nothing decodes.
    runner: Runner = "generate"


@dataclass(slots=True)
class StepPlan:
    """The requests one forward runs, with the new tokens each feeds."""

    budget: int  # tokens still allowed this step
    reqs: list[Req] = field(default_factory=list)
    chunks: list[list[int]] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)  # tokens already in KV before this step
    rids: set[str] = field(default_factory=set)

    def forward_plan(
        self,
        logit_rows: list[int],
        spans: list[PromptSpan],
        *,
        copy_slots: bool = False,
        pool_spans: list[PoolSpan] | None = None,
    ) -> ForwardPlan:
        """What the model runner needs of this plan; call once scheduling is done (the
        requests' slot lists are complete then). ``copy_slots`` for a runner on another
        thread: the engine thread goes on growing the live lists while it reads them."""
        kv_slots = [list(r.kv_slots) if copy_slots else r.kv_slots for r in self.reqs]
        prompt_lens = [len(r.input_ids) for r in self.reqs]
        return ForwardPlan(
            self.chunks,
            self.prefix_lens,
            kv_slots,
            logit_rows,
            spans,
            prompt_lens,
            pool_spans or [],
        )


class Scheduler:
    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        stop_checker: StopChecker,
        config: SchedulerConfig,
        device: torch.device | str = "cpu",
    ) -> None:
        self.runner = ModelRunner(model, kv_pool, device)
        self.kv_pool = kv_pool  # the runner writes K/V into it; slots are allocated here
        self.kv = KVCacheManager(kv_pool, config.enable_prefix_cache)
        self.stop_checker = stop_checker
        self.config = config
        # What the RPC side validates against; none of it changes after construction.
        self.limits = EngineLimits(
            vocab_size=self.runner.vocab_size,
            context_length=config.context_length,
            num_kv_tokens=kv_pool.num_tokens,
            max_waiting_requests=config.max_waiting_requests,
            runner=config.runner,
            hidden_size=model.config.hidden_size,
        )
        self.sampler = Sampler(device, stop_checker.eos_token_ids)
        self._worker = ForwardWorker(self.runner, self.sampler) if config.overlap_schedule else None
        self._inflight: InflightStep | None = None  # launched, not yet committed
        self.grammars = GrammarCompiler(
            stop_checker.tokenizer, self.runner.vocab_size, stop_checker.eos_token_ids
        )
        self._compiling: list[Req] = []  # waiting requests whose grammar is not compiled yet
        self.waiting = WaitingQueue()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self._pending_rows: list[OutputRow] = []  # final rows produced between steps
        # The tokenizer's BOS (HF tokenizers have one attribute for it; None if it has none).
        bos_token_id = getattr(stop_checker.tokenizer, "bos_token_id", None)
        self.sessions = SessionManager(self.kv, self.runner, bos_token_id)
        # Every count the scheduler keeps (steps, tokens, retractions, ...) lives here, and
        # only here, until ``take_stats`` hands it over.
        self.stats = SchedulerStats()

    # ---- requests in and out -------------------------------------------------

    def add_request(self, req: Req, *, validated: bool = False) -> None:
        """Queue a request; ALREADY_EXISTS while a request with its rid is live.
        ``validated``: ``EngineLimits.validate`` already passed it (the RPC side's), so
        only a session's joined prompt is checked again."""
        if req.rid in self.reqs:
            raise AlreadyExistsError(f"request id {req.rid!r} is already in flight", field="rid")
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise ResourceExhaustedError("scheduler waiting queue is full")
        joining = None if req.session is None else self.sessions.prepare(req, req.session)
        if not validated:
            self.validate(req)
        elif joining is not None:
            self.limits.check_fits(req)
        if req.params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device)
            req.generator.manual_seed(req.params.seed)
        spec = req.params.grammar
        if spec is not None:  # compiled on the compiler's thread; scheduled once it is done
            req.grammar = create_request_grammar(self.grammars, spec, req.params.stop_token_ids)
            self._compiling.append(req)
        if req.times.queued is None:  # the RPC side stamps it on acceptance
            req.times.queued = time.time()
        if joining is not None:
            for dropped in self.sessions.join(req, joining):
                self.abort(dropped.rid, "replaced in its session")
        self.reqs[req.rid] = req
        self.waiting.push(req)

    def validate(self, req: Req) -> None:
        """INVALID_ARGUMENT unless ``req`` could run here (``EngineLimits.validate``)."""
        self.limits.validate(req)

    def abort(self, rid: str, reason: str = "aborted") -> bool:
        """Release the request's KV and slot now; a final ``abort`` row follows with the
        next step. Idempotent: False for an unknown or already finished rid."""
        req = self.reqs.get(rid)
        if req is None or req.is_finished:
            return False
        self._end(req, FinishInfo("abort", message=reason), ReqStatus.ABORTED)
        return True

    def refuse(self, req: Req, reason: str) -> None:
        """End a request that was never queued: its only row, a final ``abort``, goes out
        with the next step, so a client that was already told "accepted" hears why."""
        req.status = ReqStatus.ABORTED
        req.finish = FinishInfo("abort", message=reason)
        self._pending_rows.append(OutputRow.of(req, [], req.finish))

    def open_session(self, session_id: str, capacity: int, owner: str) -> None:
        """Open a session (sessions.py); ALREADY_EXISTS while that id is open."""
        self.sessions.open(session_id, capacity, owner)

    def close_session(self, session_id: str, reason: str = "session closed") -> None:
        """Close a session: its running requests are aborted, its KV unpinned."""
        for req in self.sessions.close(session_id):
            self.abort(req.rid, reason)

    def close_sessions_of(self, owner: str, reason: str) -> int:
        """Close every session ``owner`` opened (its lease ended); returns how many."""
        num = len(self.sessions)
        for req in self.sessions.close_owned(owner):
            self.abort(req.rid, reason)
        return num - len(self.sessions)

    def flush_cache(self) -> bool:
        """Drop all cached prefixes; refused (False) while requests are running."""
        return not self.running and self.kv.flush()

    def take_stats(self) -> SchedulerStats:
        """What was counted since the previous call; counting starts afresh."""
        stats, self.stats = self.stats, SchedulerStats()
        return stats

    @property
    def has_work(self) -> bool:
        return bool(
            len(self.waiting) or self.running or self._pending_rows or self._inflight is not None
        )

    # ---- one step --------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[OutputRow]:
        if self._compiling:
            self._poll_grammars()
        rows, self._pending_rows = self._pending_rows, []
        if self._inflight is not None:
            if self._can_chain():
                return rows + self._chain()
            step, self._inflight = self._inflight, None
            rows.extend(self._complete(step))
        plan = self._schedule()
        if plan.reqs:
            if self._worker is not None and self._is_chainable(plan):
                self._inflight = self._launch(plan)  # its rows come with the next step
            else:
                rows.extend(self._run(plan))
        elif self._compiling and not rows:
            # Nothing runnable until a grammar compiles: wait for one rather than spin.
            futures = [r.grammar.future for r in self._compiling if r.grammar is not None]
            wait_futures(futures, timeout=0.01, return_when=FIRST_COMPLETED)
        return rows

    def _poll_grammars(self) -> None:
        """A request whose grammar has compiled may be scheduled; one whose grammar failed
        ends with ``abort`` and the reason (the frontend checks grammars, so only another
        gRPC client meets this)."""
        compiling = []
        for req in self._compiling:
            grammar = req.grammar
            if req.is_finished or grammar is None or grammar.poll():
                continue
            if grammar.error is not None:
                self._end(req, FinishInfo("abort", message=grammar.error))
            else:
                compiling.append(req)
        self._compiling = compiling

    def _schedule(self) -> StepPlan:
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        self._schedule_waiting(plan)
        return plan

    def _schedule_running(self, plan: StepPlan) -> None:
        # Decodes first (one token each), then the next chunks of prompts being prefilled.
        decodes = [r for r in self.running if r.num_uncomputed == 1]
        prefills = [r for r in self.running if r.num_uncomputed > 1]
        if len(decodes) <= plan.budget and self.kv.can_allocate(len(decodes)):
            self._plan_decodes(plan, decodes)  # the common case: room for every decode
        else:
            for req in decodes:
                if (
                    plan.budget > 0
                    and req.status is ReqStatus.RUNNING
                    and self._make_room(plan, req)
                ):
                    self._plan_chunk(plan, req, 1)
        for req in prefills:
            if plan.budget <= 0:
                return
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted to make room for a decode
            # A prefill chunk shrinks to fit rather than preempting anyone.
            num = min(req.num_uncomputed, plan.budget, self.kv.num_free + self.kv.num_evictable)
            if num > 0:
                self._plan_chunk(plan, req, num)

    def _plan_decodes(self, plan: StepPlan, reqs: list[Req]) -> None:
        """``_plan_chunk(plan, req, 1)`` for each request, with one allocation. A request
        whose input is the in-flight step's token feeds a placeholder for it."""
        for req, slot in zip(reqs, self.kv.allocate(len(reqs)), strict=True):
            start = len(req.kv_slots)
            req.kv_slots.append(slot)
            plan.reqs.append(req)
            if req.num_inflight:
                assert self._inflight is not None
                plan.chunks.append([pending_token(self._inflight.rows[req.rid])])
            else:
                plan.chunks.append(req.token_slice(start, start + 1))
            plan.prefix_lens.append(start)
            plan.rids.add(req.rid)
        plan.budget -= len(reqs)

    def _make_room(self, plan: StepPlan, req: Req) -> bool:
        """Retract others until one more token fits; end ``req`` if it never can."""
        while not self.kv.can_allocate(1):
            if not self._retract_one(plan, req):
                if not plan.reqs:  # it alone holds the pool: no step can ever extend it
                    self._end(req, FinishInfo("length", message="KV cache full"))
                return False
        return True

    def _retract_one(self, plan: StepPlan, keep: Req) -> bool:
        """Retract (send back to waiting) the lowest-priority, newest running request outside
        the plan. Prometheus calls this a preemption."""
        victims = [r for r in self.running if r is not keep and r.rid not in plan.rids]
        if not victims:
            return False
        victim = min(victims, key=lambda r: (r.priority, -(r.arrival or 0)))
        self.running.remove(victim)
        self.kv.release(victim)  # its KV stays cached (evictable): resuming may reuse it
        victim.status = ReqStatus.WAITING
        victim.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting.push(victim)
        logger.info("retracted rid=%s (label %s) to free KV", victim.rid, victim.label)
        return True

    def _schedule_waiting(self, plan: StepPlan) -> None:
        sharing = [r for r in self.running if self._is_computing_prompt(r)]
        for req in self.waiting:
            if plan.budget <= 0 or len(self.running) >= self.config.max_running_requests:
                return
            if req.grammar is not None and req.grammar.matcher is None:
                continue  # its grammar is still compiling
            if any(r.input_ids == req.input_ids for r in sharing):
                continue  # wait for that prompt's KV to be cached, then share it
            if not self._admit(plan, req):
                return
            if self._is_computing_prompt(req):
                sharing.append(req)

    def _is_computing_prompt(self, req: Req) -> bool:
        """True while more than the last prompt token of ``req`` is still to be cached:
        a request with the same prompt (one of n choices) admitted now would compute
        the same KV again instead of sharing it."""
        return self.kv.tree is not None and req.num_tree_tokens < len(req.input_ids) - 1

    def _admit(self, plan: StepPlan, req: Req) -> bool:
        num_matched = self.kv.match(req)
        num = min(req.num_uncomputed, plan.budget)
        if not self.kv.can_allocate(num):
            self.kv.unmatch(req)
            return False
        if req.num_retractions == 0:
            req.num_cached_tokens = min(num_matched, len(req.input_ids))
            req.times.scheduled = time.time()
            if self.kv.tree is not None:
                self.stats.num_prefix_cache_queries += len(req.input_ids)
                self.stats.num_prefix_cache_hits += req.num_cached_tokens
        self.waiting.remove(req)
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        self._plan_chunk(plan, req, num)
        return True

    def _plan_chunk(self, plan: StepPlan, req: Req, num: int) -> None:
        start = req.num_computed
        req.kv_slots.extend(self.kv.allocate(num))
        plan.reqs.append(req)
        plan.chunks.append(req.token_slice(start, start + num))
        plan.prefix_lens.append(start)
        plan.rids.add(req.rid)
        plan.budget -= num

    def _run(self, plan: StepPlan) -> list[OutputRow]:
        # A request whose every token is in KV after this step samples its next one,
        # unless it asked for none (scoring a prompt: it ends here).
        done = [i for i, r in enumerate(plan.reqs) if r.num_uncomputed == 0]
        rows = [i for i in done if plan.reqs[i].params.max_new_tokens > 0]
        reqs = [plan.reqs[i] for i in rows]
        # What the sampler needs beside the logits (grammar bitmasks) is known now: it
        # starts first and builds beside the forward.
        self.sampler.prepare(reqs, self.runner.vocab_size, self.runner.device)
        spans = plan_spans(plan.reqs, plan.prefix_lens, plan.chunks)
        pool_spans = plan_pool_spans(plan.reqs, plan.prefix_lens, plan.chunks)
        out = self.runner.run(plan.forward_plan(rows, spans, pool_spans=pool_spans))
        record_spans(plan.reqs, spans, out.prompt_logprobs)
        record_pool_spans(plan.reqs, pool_spans, out.pooled)
        self.stats.step_tokens.append(sum(map(len, plan.chunks)))
        for req, prefix_len in zip(plan.reqs, plan.prefix_lens, strict=True):
            if prefix_len < len(req.input_ids):
                self.kv.cache_prefix(req)  # share the prompt as soon as it is computed
        scored = [plan.reqs[i] for i in done if plan.reqs[i].params.max_new_tokens == 0]
        ended = [self._end_prompt_only(req) for req in scored]
        if not reqs:
            return ended
        return ended + self._commit(reqs, self.sampler.sample(out.logits, reqs))

    # ---- overlap scheduling (overlap.py) ---------------------------------------------

    def _is_chainable(self, plan: StepPlan) -> bool:
        """A plan that may run in flight: every request decodes one token and samples it."""
        return all(
            len(chunk) == 1 and prefix_len >= len(req.input_ids) and can_chain(req)
            for req, chunk, prefix_len in zip(plan.reqs, plan.chunks, plan.prefix_lens, strict=True)
        )

    def _can_chain(self) -> bool:
        """Whether the next step may be planned on top of the in-flight one: only decodes
        of plain requests, room for all of them, no request that could be admitted."""
        running = self.running
        if len(self.waiting) and len(running) < self.config.max_running_requests:
            return False
        if len(running) > self.config.max_num_batched_tokens:
            return False
        if not self.kv.can_allocate(len(running)):
            return False
        return all(r.num_uncomputed == 1 and can_chain(r) for r in running)

    def _chain(self) -> list[OutputRow]:
        """Launch the next decode step, then commit the one in flight."""
        previous = self._inflight
        assert previous is not None
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        # A request whose in-flight token is its last by length is not planned again: that
        # row would only be dropped (or run past the context).
        ends = self.stop_checker.reaches_length
        going_on = [r for r in self.running if not ends(r, len(r.output_ids) + r.num_inflight)]
        self._plan_decodes(plan, going_on)
        self._inflight = self._launch(plan, previous) if plan.reqs else None
        return self._complete(previous)

    def _launch(self, plan: StepPlan, previous: InflightStep | None = None) -> InflightStep:
        assert self._worker is not None
        reqs = plan.reqs
        forward = plan.forward_plan(list(range(len(reqs))), [], copy_slots=True)
        for req in reqs:
            req.num_inflight += 1
        future = self._worker.submit(forward, reqs, previous)
        return InflightStep(reqs, {r.rid: i for i, r in enumerate(reqs)}, future)

    def _complete(self, step: InflightStep) -> list[OutputRow]:
        """Wait for a launched step and commit it."""
        out = step.future.result()
        for req in step.reqs:
            req.num_inflight -= 1
        self.stats.step_tokens.append(len(step.reqs))
        return self._commit(step.reqs, out)

    def _end_prompt_only(self, req: Req) -> OutputRow:
        """A request with max_new_tokens 0 ends once its prompt is computed (and scored):
        ``length``, no token sampled. A pooling request did all it asked (``stop``), and
        its one row carries its vector."""
        finish = FinishInfo("length" if req.pooling is None else "stop")
        self._finish(req, finish, ReqStatus.FINISHED)
        if req.pooling is None:
            return self._take_row(req, finish)
        return OutputRow.of(req, [], finish, embedding=req.pooling.result(len(req.input_ids)))

    def _commit(self, reqs: list[Req], out: SampleOutput) -> list[OutputRow]:
        rows = []
        now = time.time()
        for req, token, logprob in zip(reqs, out.token_ids, out.logprobs, strict=True):
            if req.is_finished:  # ended while its step was in flight: the token is dropped
                continue
            req.output_ids.append(token)
            if req.last_token_time is None:
                req.times.first_token = now
            self.stats.on_token(req, now)
            req.last_token_time = now
            if logprob:
                req.unsent_logprobs.append(logprob)
            finish = self.stop_checker.check(req)
            if finish is not None:
                self._finish(req, finish, ReqStatus.FINISHED)
            if finish is not None or self._row_due(req):
                rows.append(self._take_row(req, finish))
        return rows

    def _row_due(self, req: Req) -> bool:
        """Whether a live request reports now: streamed ones at their first token and then
        every ``stream_interval`` tokens, unary ones never before their end."""
        if not req.stream:
            return False
        unsent = len(req.output_ids) - req.num_sent_ids
        return req.num_sent_ids == 0 or unsent >= self.config.stream_interval

    def _take_row(self, req: Req, finish: FinishInfo | None) -> OutputRow:
        """A row with every token (and logprob) not yet reported."""
        new_ids = req.output_ids[req.num_sent_ids :]
        req.num_sent_ids = len(req.output_ids)
        logprobs, req.unsent_logprobs = req.unsent_logprobs, []
        return OutputRow.of(req, new_ids, finish, logprobs)

    def _end(self, req: Req, finish: FinishInfo, status: ReqStatus = ReqStatus.FINISHED) -> None:
        """End a request outside the sampling path; its final row goes out next step."""
        self._finish(req, finish, status)
        self._pending_rows.append(self._take_row(req, finish))

    def _finish(self, req: Req, finish: FinishInfo, status: ReqStatus) -> None:
        """The one place a request leaves the scheduler and its KV is released."""
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        req.finish = finish
        req.status = status
        req.times.finished = time.time()
        if req.session is not None:
            self.sessions.on_finish(req)  # keeps a complete request's tokens in KV
        self.kv.release(req)
        self.reqs.pop(req.rid, None)
        self.stats.finished.append(FinishedReqStats.of(req))
