"""The RPC side of the engine boundary: answers at once, never waits for a step.

``add_request`` and ``abort`` validate against ``EngineLimits``, check the live-rid
table, queue a command and return; a request submitted mid-step joins the next step.
Any other command goes through ``ask`` (its future is resolved when the engine's
output carries the answer) or ``tell`` (nobody waits).

``handle`` takes each ``EngineOutput`` in order, on whichever thread delivers it (the
engine thread itself, or the reader of the engine process): it releases finished rids,
publishes the gauges, hands the step's counts to ``on_stats`` and its rows to ``sink``
(which may block: that is how a slow detokenizer stalls the engine), then resolves
answers. Commands wait in ``inbox``, a bounded queue; subclasses say who takes them to
the engine and run it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from services.common.errors import (
    AlreadyExistsError,
    ResourceExhaustedError,
    TokenlineError,
)
from services.scheduler.core.commands import (
    NO_TICKET,
    AbortCommand,
    AddCommand,
    EngineCommand,
    Ticketed,
)
from services.scheduler.core.messages import Answer, EngineLimits, EngineOutput, EngineStats
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import Req
from services.scheduler.core.stats import SchedulerStats

T = TypeVar("T")

# Takes a step's rows; may block (a slow detokenizer stalls the engine through it).
RowSink = Callable[[Sequence[OutputRow]], None]


class LiveRids:
    """The rids this scheduler holds, from acceptance to their final row: the table the
    RPC side answers duplicates, capacity and ``Abort.found`` from. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._aborting: dict[str, bool] = {}  # rid -> an abort was already requested

    def __len__(self) -> int:
        return len(self._aborting)

    def claim(self, rid: str) -> None:
        with self._lock:
            if rid in self._aborting:
                raise AlreadyExistsError(f"request id {rid!r} is already in flight", field="rid")
            if len(self._aborting) >= self.capacity:
                raise ResourceExhaustedError("scheduler waiting queue is full, retry later")
            self._aborting[rid] = False

    def mark_aborting(self, rid: str) -> bool:
        """True the first time a live rid is aborted; False when unknown or already aborting."""
        with self._lock:
            if self._aborting.get(rid, True):
                return False
            self._aborting[rid] = True
            return True

    def unmark_aborting(self, rid: str) -> None:
        """The abort could not be queued: a later one may try again."""
        with self._lock:
            if rid in self._aborting:
                self._aborting[rid] = False

    def release(self, rid: str) -> None:
        with self._lock:
            self._aborting.pop(rid, None)


class EngineClient:
    def __init__(
        self,
        limits: EngineLimits,
        sink: RowSink,
        on_stats: Callable[[SchedulerStats], None] | None = None,
        on_fatal: Callable[[], None] | None = None,
        inbox_size: int = 8192,
    ) -> None:
        self.limits = limits
        # Commands for the engine, in order; ``None`` asks it to stop.
        self.inbox: queue.Queue[Ticketed | None] = queue.Queue(inbox_size)
        self.sink = sink
        self.on_stats = on_stats
        self.on_fatal = on_fatal  # called once, on the failing thread, if the engine dies
        # Live rids include running ones, so the engine's own waiting-queue bound can never
        # refuse a request this side accepted.
        self.live = LiveRids(limits.max_waiting_requests)
        self.stats = EngineStats(
            num_free_kv_tokens=limits.num_kv_tokens, num_total_kv_tokens=limits.num_kv_tokens
        )
        self.fatal_error: BaseException | None = None
        self._engine_idle = True
        self._num_unapplied = 0  # commands queued and not yet applied; under _lock
        self._tickets = itertools.count(1)
        # ticket -> (the caller's future, the rid of a session request to release on refusal)
        self._waiting: dict[int, tuple[concurrent.futures.Future, str | None]] = {}
        self._lock = threading.Lock()

    # ---- run by subclasses ---------------------------------------------------------

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _ask_to_stop(self) -> None:
        """Queue the stop, after every command queued before it (dropped if the inbox is
        full: the engine is stopped by other means then)."""
        with contextlib.suppress(queue.Full):
            self.inbox.put_nowait(None)

    def _failed(self, error: BaseException) -> None:
        self.fatal_error = error
        if self.on_fatal is not None:
            self.on_fatal()

    # ---- RPC side ------------------------------------------------------------------

    @property
    def is_idle(self) -> bool:
        """No request queued or running and no command unapplied; its rows were handed over."""
        return self._engine_idle and self._num_unapplied == 0

    def add_request(self, req: Req) -> concurrent.futures.Future[None] | None:
        """Accept ``req`` or raise (INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED).
        The one validation it gets: the engine takes it as accepted here. A request in a
        session depends on the session's state, which only the engine reads: for it the
        answer is the returned future."""
        self.limits.validate(req)
        self.live.claim(req.rid)
        # Accepted now: the wait for the engine's next step is queueing, not dispatch.
        req.times.queued = time.time()
        try:
            if req.session is not None:
                return self._ask(AddCommand(req), release=req.rid)
            self.tell(AddCommand(req))
        except ResourceExhaustedError:
            self.live.release(req.rid)
            raise
        return None

    def abort(self, rid: str, reason: str) -> bool:
        """Ask the engine to end ``rid``; False when it is unknown or already being aborted."""
        if not self.live.mark_aborting(rid):
            return False
        try:
            self.tell(AbortCommand(rid, reason))
        except ResourceExhaustedError:
            self.live.unmark_aborting(rid)
            raise
        return True

    def ask(self, command: EngineCommand[T]) -> concurrent.futures.Future[T]:
        """Send ``command``; the future gets what its ``apply`` returns on the engine, or
        the ``TokenlineError`` it raises. Non-blocking; RESOURCE_EXHAUSTED when the inbox
        is full."""
        return self._ask(command)

    def tell(self, command: EngineCommand[Any]) -> None:
        """Send ``command`` with nobody waiting on its answer. Non-blocking;
        RESOURCE_EXHAUSTED when the inbox is full."""
        self._submit(NO_TICKET, command)

    def _ask(
        self, command: EngineCommand[T], release: str | None = None
    ) -> concurrent.futures.Future[T]:
        """``release``: a rid to drop from the live table if the engine refuses."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        ticket = self._ticket(done, release)
        try:
            self._submit(ticket, command)
        except ResourceExhaustedError:
            self._forget(ticket)
            raise
        return done

    def _submit(self, ticket: int, command: EngineCommand[Any]) -> None:
        with self._lock:
            self._num_unapplied += 1
        try:
            self.inbox.put_nowait((ticket, command))
        except queue.Full:
            with self._lock:
                self._num_unapplied -= 1
            raise ResourceExhaustedError("scheduler inbox is full, retry later") from None

    def _ticket(self, done: concurrent.futures.Future, rid: str | None = None) -> int:
        ticket = next(self._tickets)
        with self._lock:
            self._waiting[ticket] = (done, rid)
        return ticket

    def _forget(self, ticket: int) -> None:
        with self._lock:
            self._waiting.pop(ticket, None)

    # ---- outputs, in order, on the delivering thread -------------------------------

    def handle(self, output: EngineOutput) -> None:
        if not output.idle:  # before the applied count drops: never idle in between
            self._engine_idle = False
        if output.num_applied:
            with self._lock:
                self._num_unapplied -= output.num_applied
        for row in output.rows:
            if row.finish is not None:
                self.live.release(row.rid)
        self.stats = output.engine_stats
        if output.stats is not None and self.on_stats is not None:
            self.on_stats(output.stats)
        if output.rows:
            self.sink(output.rows)
        for ticket, answer in output.answers:
            self._resolve(ticket, answer)
        self._engine_idle = output.idle  # idle only once its rows were handed over

    def _resolve(self, ticket: int, answer: Answer) -> None:
        """Resolve a waiting caller's future; one whose caller gave up is left alone."""
        with self._lock:
            done, rid = self._waiting.pop(ticket, (None, None))
        if done is None:
            return
        if isinstance(answer, TokenlineError) and rid is not None:
            self.live.release(rid)  # a refused session request: no row will follow
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if isinstance(answer, TokenlineError):
                done.set_exception(answer)
            else:
                done.set_result(answer)
