"""The scheduler core: continuous batching over a KV pool, no transport.

``Scheduler.step()`` runs one engine step as three calls: ``schedule()`` decides what the
forward runs (a ``SchedulerOutput``), ``StepExecutor.execute`` runs the forward and the
sampler (executor.py), and ``commit()`` applies the result: stop checks, KV released for
what finished, and the rows to send downstream. It is single-threaded by contract (the
engine thread owns it); tests call it directly. With ``overlap_schedule`` the same calls
are pipelined: a step's execute runs on a forward worker thread while the next step is
scheduled and the one before is committed (overlap.py).

Owns the scheduling policy, every ``Req``'s state, KV slot allocation (through
``KVCacheManager``) and stop checks. The forward itself, and every device tensor it needs,
belong to ``ModelRunner``; sampling to ``Sampler``: both are built by the caller (with the
machine's compiled kernels, transport/engine_build.py) and only ``execute`` calls them.

Scheduling per step, under a token budget: the last tokens of finished session requests
(their K/V only), running requests (decodes take one token each; a prompt being prefilled
takes a chunk), retracting the lowest-priority, newest running request when KV runs out;
then waiting requests in priority order, each starting from its longest cached prefix.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from services.common.errors import AlreadyExistsError, ResourceExhaustedError
from services.scheduler.core.executor import StepExecutor
from services.scheduler.core.messages import EngineLimits, Runner
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.overlap import (
    ForwardWorker,
    InflightStep,
    can_chain,
    is_chainable_step,
)
from services.scheduler.core.req import FinishInfo, Req, ReqStatus
from services.scheduler.core.scheduler_output import (
    ExecuteOutput,
    SchedulerOutput,
    pending_token,
)
from services.scheduler.core.sessions import SessionManager
from services.scheduler.core.stats import FinishedReqStats, SchedulerStats
from services.scheduler.core.stop_checker import StopChecker
from services.scheduler.core.waiting_queue import WaitingQueue
from services.scheduler.mem_cache.kv_cache import KVCacheManager
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.model_runner import CausalLM, ModelRunner
from services.scheduler.model_executor.pooling import plan_pool_spans, record_pool_spans
from services.scheduler.ops.cpu_kernels import SampleKernel
from services.scheduler.sampling.grammar import GrammarCompiler, create_request_grammar
from services.scheduler.sampling.prompt_logprobs import plan_spans, record_spans
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


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        stop_checker: StopChecker,
        config: SchedulerConfig,
    ) -> None:
        self.runner = runner
        self.sampler = sampler
        self.executor = StepExecutor(runner, sampler)
        self.kv_pool = runner.kv_pool  # the runner writes K/V into it; slots are allocated here
        self.kv = KVCacheManager(self.kv_pool, config.enable_prefix_cache)
        self.stop_checker = stop_checker
        self.config = config
        # What the RPC side validates against; none of it changes after construction.
        self.limits = EngineLimits(
            vocab_size=runner.vocab_size,
            context_length=config.context_length,
            num_kv_tokens=self.kv_pool.num_tokens,
            max_waiting_requests=config.max_waiting_requests,
            runner=config.runner,
            hidden_size=runner.model.config.hidden_size,
        )
        self._worker = ForwardWorker(self.executor) if config.overlap_schedule else None
        scaling = runner.model.config.rope_scaling
        # LongRoPE (Phi-3): past this many tokens a sequence's keys use the long factors.
        self._long_rope_from = (
            scaling.original_max_position_embeddings if scaling.has_long_factors else None
        )
        self._inflight: InflightStep | None = None  # submitted, not yet committed
        self.grammars = GrammarCompiler(
            stop_checker.tokenizer, runner.vocab_size, stop_checker.eos_token_ids
        )
        self._compiling: list[Req] = []  # waiting requests whose grammar is not compiled yet
        self.waiting = WaitingQueue()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self._pending_rows: list[OutputRow] = []  # final rows produced between steps
        # Finished session requests whose last token's K/V the next step computes; they
        # keep their KV until it is committed (``_schedule_last_tokens``).
        self._last_tokens: list[Req] = []
        # The tokenizer's BOS (HF tokenizers have one attribute for it; None if it has none).
        bos_token_id = getattr(stop_checker.tokenizer, "bos_token_id", None)
        self.sessions = SessionManager(self.kv, bos_token_id)
        # Every count the scheduler keeps (steps, tokens, retractions, ...) lives here, and
        # only here, until ``take_stats`` hands it over.
        self.stats = SchedulerStats()

    @classmethod
    def create(
        cls,
        model: CausalLM,
        kv_pool: KVPool,
        stop_checker: StopChecker,
        config: SchedulerConfig,
        device: torch.device | str = "cpu",
        sample_kernel: SampleKernel | None = None,
    ) -> Scheduler:
        """A scheduler with a runner of ``model`` over ``kv_pool`` and a sampler of its own
        (with ``sample_kernel`` where one is loaded): what tests and benchmarks build."""
        runner = ModelRunner(model, kv_pool, device)
        sampler = Sampler(runner.device, stop_checker.eos_token_ids, kernel=sample_kernel)
        return cls(runner, sampler, stop_checker, config)

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
            len(self.waiting)
            or self.running
            or self._pending_rows
            or self._inflight is not None
            or self._last_tokens
        )

    # ---- one step: schedule -> execute -> commit -----------------------------------

    @torch.inference_mode()
    def step(self) -> list[OutputRow]:
        """``schedule()``, ``execute``, ``commit()``. With overlap scheduling the step's
        execute is submitted to the forward worker and committed by the next call: after
        that call has scheduled and submitted its own step when the two may overlap
        (``_can_pipeline``), before it schedules otherwise."""
        if self._compiling:
            self._poll_grammars()
        rows, self._pending_rows = self._pending_rows, []
        previous = self._inflight
        if previous is not None and not self._can_pipeline(previous):
            self._inflight = None
            rows.extend(self._commit_inflight(previous))
            previous = None
        out = self.schedule()  # its placeholders name rows of ``self._inflight``
        self._inflight = None
        if out.reqs and self._worker is None:
            rows.extend(self.commit(out, self.executor.execute(out)))
        elif out.reqs:
            self._inflight = self._submit(out, previous)
        if previous is not None:
            rows.extend(self._commit_inflight(previous))
        elif not out.reqs and self._compiling and not rows:
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

    # ---- schedule ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step under the token budget and allocate the KV slots of every
        token it computes. Changes request and queue state (admissions, retractions), so
        every plan is executed and committed, in order."""
        out = SchedulerOutput(self.config.max_num_batched_tokens)
        if self._last_tokens:
            self._schedule_last_tokens(out)
        self._schedule_running(out)
        if len(self.waiting):
            self._schedule_waiting(out)
        self._close(out)
        return out

    def _schedule_last_tokens(self, out: SchedulerOutput) -> None:
        """Each finished session request computes its last token's K/V (a chunk that
        samples nothing; its KV is pinned when committed). Without a slot to spare, its KV
        is pinned as it is: the next turn recomputes that token."""
        finishing, self._last_tokens = self._last_tokens, []
        for req in finishing:
            if out.budget > 0 and self.kv.can_allocate(1):
                out.kv_only_rows.append(len(out.reqs))
                self._plan_chunk(out, req, 1)
            else:
                self._keep_session_kv(req)

    def _schedule_running(self, out: SchedulerOutput) -> None:
        # Decodes first (one token each), then the next chunks of prompts being prefilled.
        # A request whose in-flight token is its last by length is not scheduled again: that
        # row would only be dropped (or run past the context).
        ends = self.stop_checker.reaches_length
        decodes, prefills, crossing = [], [], []
        for r in self.running:
            if self._passes_original_context(r):
                crossing.append(r)
                continue
            num = r.num_uncomputed
            if num > 1:
                prefills.append(r)
            elif num == 1 and not (r.num_inflight and ends(r, len(r.output_ids) + r.num_inflight)):
                decodes.append(r)
        for r in crossing:
            if not r.num_inflight:  # else its token is not known yet: the next step
                self._recompute_long(r)
        if len(decodes) <= out.budget and self.kv.can_allocate(len(decodes)):
            self._plan_decodes(out, decodes)  # the common case: room for every decode
        else:
            for req in decodes:
                if out.budget > 0 and req.status is ReqStatus.RUNNING and self._make_room(out, req):
                    self._plan_chunk(out, req, 1)
        for req in prefills:
            if out.budget <= 0:
                return
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted to make room for a decode
            # A prefill chunk shrinks to fit rather than preempting anyone.
            num = min(req.num_uncomputed, out.budget, self.kv.num_free + self.kv.num_evictable)
            if num > 0:
                self._plan_chunk(out, req, num)

    def _passes_original_context(self, req: Req) -> bool:
        """Whether ``req``'s next token is its first past LongRoPE's original context while
        its keys so far were rotated by the short factors."""
        limit = self._long_rope_from
        return (
            limit is not None
            and self.kv.tree is None  # a cache would hand the short-factor keys back
            and (req.rope_len or len(req.input_ids)) <= limit
            and req.num_computed == limit
            and req.num_uncomputed == 1
        )

    def _recompute_long(self, req: Req) -> None:
        """Send ``req`` back to waiting without its KV, to be prefilled again as one
        sequence past the original context, every key with the long factors: what HF's
        ``generate`` does at that token (Phi-3's ``prepare_inputs_for_generation`` drops its
        cache), so the tokens after it stay HF's. Once per request. The prefix cache is off
        for LongRoPE checkpoints, so none of the short-factor keys is kept for reuse."""
        self.running.remove(req)
        req.rope_len = req.num_computed + req.num_uncomputed
        self.kv.release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1  # resumed, not admitted anew (``_admit``)
        self.waiting.push(req)
        logger.info(
            "rid=%s passed the original context: recomputed with LongRoPE's long factors", req.rid
        )

    def _plan_decodes(self, out: SchedulerOutput, reqs: list[Req]) -> None:
        """``_plan_chunk(out, req, 1)`` for each request, with one allocation. A request
        whose input is the in-flight step's token feeds a placeholder for it."""
        for req, slot in zip(reqs, self.kv.allocate(len(reqs)), strict=True):
            start = len(req.kv_slots)
            req.kv_slots.append(slot)
            i = len(out.reqs)
            out.reqs.append(req)
            if req.num_inflight:
                assert self._inflight is not None
                out.new_token_ids.append([pending_token(self._inflight.rows[req.rid])])
                out.has_placeholders = True
            else:
                out.new_token_ids.append(req.token_slice(start, start + 1))
            out.prefix_lens.append(start)
            if start < len(req.input_ids):
                self._mark(out, i, req, start)  # its last prompt token
            else:
                out.sample_rows.append(i)  # a decode: its one new token fills its KV
        out.num_tokens += len(reqs)

    def _make_room(self, out: SchedulerOutput, req: Req) -> bool:
        """Retract others until one more token fits; end ``req`` if it never can."""
        while not self.kv.can_allocate(1):
            if not self._retract_one(out, req):
                if not out.reqs:  # it alone holds the pool: no step can ever extend it
                    self._end(req, FinishInfo("length", message="KV cache full"))
                return False
        return True

    def _retract_one(self, out: SchedulerOutput, keep: Req) -> bool:
        """Retract (send back to waiting) the lowest-priority, newest running request outside
        the step. Prometheus calls this a preemption."""
        victims = [r for r in self.running if r is not keep and r not in out.reqs]
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

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        sharing = [r for r in self.running if self._is_computing_prompt(r)]
        # A continuation waits for its parent's last token to be computed and pinned.
        settling = {out.reqs[i].rid for i in out.kv_only_rows}
        for req in self.waiting:
            if out.budget <= 0 or len(self.running) >= self.config.max_running_requests:
                return
            if req.grammar is not None and req.grammar.matcher is None:
                continue  # its grammar is still compiling
            if any(r.input_ids == req.input_ids for r in sharing):
                continue  # wait for that prompt's KV to be cached, then share it
            if settling and req.session is not None and req.session.rid in settling:
                continue
            if not self._admit(out, req):
                return
            if self._is_computing_prompt(req):
                sharing.append(req)

    def _is_computing_prompt(self, req: Req) -> bool:
        """True while more than the last prompt token of ``req`` is still to be cached:
        a request with the same prompt (one of n choices) admitted now would compute
        the same KV again instead of sharing it."""
        return self.kv.tree is not None and req.num_tree_tokens < len(req.input_ids) - 1

    def _admit(self, out: SchedulerOutput, req: Req) -> bool:
        num_matched = self.kv.match(req)
        num = min(req.num_uncomputed, out.budget)
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
        self._plan_chunk(out, req, num)
        return True

    def _plan_chunk(self, out: SchedulerOutput, req: Req, num: int) -> None:
        start = req.num_computed
        req.kv_slots.extend(self.kv.allocate(num))
        out.reqs.append(req)
        out.new_token_ids.append(req.token_slice(start, start + num))
        out.prefix_lens.append(start)
        out.num_tokens += num
        self._mark(out, len(out.reqs) - 1, req, start)

    @staticmethod
    def _mark(out: SchedulerOutput, i: int, req: Req, start: int) -> None:
        """What the step does with row ``i`` beyond its forward: a chunk of the prompt is
        cached once computed (and may be scored or pooled); a request with every token in
        KV after the step samples its next one, or ends there if it asked for none."""
        if start < len(req.input_ids):
            out.prompt_rows.append(i)
        if req.num_uncomputed == 0 and not req.is_finished:  # finished: a KV-only row
            rows = out.sample_rows if req.params.max_new_tokens > 0 else out.prompt_only_rows
            rows.append(i)

    def _close(self, out: SchedulerOutput) -> None:
        """Complete a plan whose chunks are all in: the prompt rows to score and pool (only
        chunks of a prompt have any), and the slot lists."""
        reqs = out.reqs
        if out.prompt_rows:
            out.prompt_spans = plan_spans(reqs, out.prefix_lens, out.new_token_ids)
            out.pool_spans = plan_pool_spans(reqs, out.prefix_lens, out.new_token_ids)
        out.kv_slots = [req.kv_slots for req in reqs]

    # ---- overlap scheduling (overlap.py) ---------------------------------------------

    def _can_pipeline(self, inflight: InflightStep) -> bool:
        """Whether the next step may be scheduled before ``inflight`` is committed: it ran
        only decodes of plain requests, and so will the next (no request that could be
        admitted, room for every decode)."""
        if not inflight.is_chainable or self._last_tokens:
            return False
        running = self.running
        if len(self.waiting) and len(running) < self.config.max_running_requests:
            return False
        if len(running) > self.config.max_num_batched_tokens:
            return False
        if not self.kv.can_allocate(len(running)):
            return False
        return all(r.num_uncomputed == 1 and can_chain(r) for r in running)

    def _submit(self, out: SchedulerOutput, previous: InflightStep | None) -> InflightStep:
        """Hand ``out`` to the forward worker, after ``previous`` when it is in flight (its
        sample fills the placeholders). A step scheduled on top of one in flight holds
        only decodes of plain requests, so it is chainable too."""
        assert self._worker is not None
        # The engine thread goes on growing the live slot lists while the worker reads them.
        out.kv_slots = [list(slots) for slots in out.kv_slots]
        sampled = [out.reqs[i] for i in out.sample_rows]
        for req in sampled:
            req.num_inflight += 1
        future = self._worker.submit(out, None if previous is None else previous.future)
        is_chainable = previous is not None or is_chainable_step(out)
        return InflightStep(out, {r.rid: j for j, r in enumerate(sampled)}, future, is_chainable)

    def _commit_inflight(self, step: InflightStep) -> list[OutputRow]:
        """Wait for a submitted step's result and commit it."""
        result = step.future.result()
        out = step.out
        for i in out.sample_rows:
            out.reqs[i].num_inflight -= 1
        return self.commit(out, result)

    # ---- commit --------------------------------------------------------------------

    def commit(self, out: SchedulerOutput, result: ExecuteOutput) -> list[OutputRow]:
        """Apply an executed step: prompt logprobs and pooled rows gathered, computed prompts
        shared in the prefix cache, finished sessions' KV pinned, prompt-only requests
        ended, sampled tokens appended and checked for stops. Returns the rows due now."""
        reqs = out.reqs
        record_spans(reqs, out.prompt_spans, result.prompt_logprobs)
        record_pool_spans(reqs, out.pool_spans, result.pooled)
        self.stats.step_tokens.append(out.num_tokens)
        for i in out.prompt_rows:
            self.kv.cache_prefix(reqs[i])  # share the prompt as soon as it is computed
        for i in out.kv_only_rows:
            self._keep_session_kv(reqs[i])
        # A request ended while its step was in flight (an abort) is skipped.
        ended = [reqs[i] for i in out.prompt_only_rows if not reqs[i].is_finished]
        rows = [self._end_prompt_only(req) for req in ended]
        if out.sample_rows:
            rows += self._commit_tokens([reqs[i] for i in out.sample_rows], result.sampled)
        return rows

    def _end_prompt_only(self, req: Req) -> OutputRow:
        """A request with max_new_tokens 0 ends once its prompt is computed (and scored):
        ``length``, no token sampled. A pooling request did all it asked (``stop``), and
        its one row carries its vector."""
        finish = FinishInfo("length" if req.pooling is None else "stop")
        self._finish(req, finish, ReqStatus.FINISHED)
        if req.pooling is None:
            return self._take_row(req, finish)
        return OutputRow.of(req, [], finish, embedding=req.pooling.result(len(req.input_ids)))

    def _commit_tokens(self, reqs: list[Req], out: SampleOutput) -> list[OutputRow]:
        """Append each request's sampled token, check it for a stop, and make the rows due."""
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
        if req.session is not None and self.sessions.on_finish(req):
            self._last_tokens.append(req)  # keeps its KV until its last token is computed
        else:
            self.kv.release(req)
        self.reqs.pop(req.rid, None)
        self.stats.finished.append(FinishedReqStats.of(req))

    def _keep_session_kv(self, req: Req) -> None:
        """A finished session request whose last token was computed (or found no slot):
        its tokens pinned for its session, then its KV released like any other's."""
        self.sessions.pin(req)
        self.kv.release(req)
