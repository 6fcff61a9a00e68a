"""Runs the Scheduler on its own thread; the gRPC side never waits for a step.

Two halves with one rule: only the engine thread touches ``Scheduler`` and ``Req``.

* Loop side (``add_request``, ``abort``): validate from immutable config, check the
  live-rid table, put a command in the inbox and answer at once. A request submitted
  mid-step joins the next step; its RPC does not wait for it.
* Engine thread: drains the inbox between steps, steps, and hands each step's rows
  (immutable ``OutputRow`` snapshots) to ``sink``. In the server the sink is the
  detokenizer pusher, which moves them onto the event loop with
  ``call_soon_threadsafe`` and bounds how many steps may be in flight.

After each step the engine thread publishes ``EngineStats`` (queue and KV gauges, read
by any thread) and hands the step's ``SchedulerStats`` (the counts) to ``on_stats``.

Torch releases the GIL during kernels, so both sides make progress.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import (
    AlreadyExistsError,
    ResourceExhaustedError,
    TokenlineError,
)
from services.scheduler.engine import OutputRow, Scheduler
from services.scheduler.req import Req
from services.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)

RowSink = Callable[[list[OutputRow]], None]


@dataclass(frozen=True, slots=True)
class AddCommand:
    req: Req
    # A request in a session is checked against the session on the engine thread, which
    # answers here (None, or the refusal); other requests are answered on the loop side.
    done: concurrent.futures.Future[None] | None = None


@dataclass(frozen=True, slots=True)
class OpenSessionCommand:
    session_id: str
    capacity: int
    owner: str
    done: concurrent.futures.Future[None]


@dataclass(frozen=True, slots=True)
class CloseSessionCommand:
    session_id: str
    done: concurrent.futures.Future[None]


@dataclass(frozen=True, slots=True)
class AbortCommand:
    rid: str
    reason: str


@dataclass(frozen=True, slots=True)
class AbortStartedCommand:
    """Abort every live request whose first row already went downstream."""

    reason: str


@dataclass(frozen=True, slots=True)
class AbortOwnedCommand:
    """Abort every live request that ``owner`` (a frontend id) sent: its lease ended."""

    owner: str
    reason: str


@dataclass(frozen=True, slots=True)
class FlushOutcome:
    """What a flush found: it empties the prefix cache only when nothing is in flight."""

    flushed: bool
    num_running: int
    num_waiting: int
    reason: str = ""  # why not, when not flushed


@dataclass(frozen=True, slots=True)
class FlushCommand:
    """Empty the prefix cache unless a request is running or waiting (SGLang refuses
    then too); the engine thread answers through ``done``."""

    done: concurrent.futures.Future[FlushOutcome]


Command = (
    AddCommand
    | AbortCommand
    | AbortStartedCommand
    | AbortOwnedCommand
    | FlushCommand
    | OpenSessionCommand
    | CloseSessionCommand
)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state (queues and KV), published after every step; read from any
    thread. Gauges only: what the engine counts goes through ``SchedulerStats``."""

    num_waiting: int = 0
    num_running: int = 0
    num_free_kv_tokens: int = 0
    num_total_kv_tokens: int = 0
    num_cached_kv_tokens: int = 0  # in the prefix cache, shared or evictable
    num_evictable_kv_tokens: int = 0  # cached and held by no request
    num_sessions: int = 0


class LiveRids:
    """The rids this scheduler holds, from acceptance to their final row: the table the
    loop side answers duplicates, capacity and ``Abort.found`` from. Thread-safe."""

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


class EngineThread:
    def __init__(
        self,
        scheduler: Scheduler,
        sink: RowSink,
        inbox_size: int = 8192,
        on_stats: Callable[[SchedulerStats], None] | None = None,
    ):
        self.scheduler = scheduler
        self.sink = sink  # gets each step's rows on this thread; may block (backpressure)
        self.on_stats = on_stats  # gets the engine's counts after every step, on this thread
        self.inbox: queue.Queue[Command | None] = queue.Queue(inbox_size)
        # Live rids include running ones, so the engine's own waiting-queue bound can never
        # refuse a request this side accepted.
        self.live = LiveRids(scheduler.config.max_waiting_requests)
        self.stats = EngineStats(num_total_kv_tokens=scheduler.kv_pool.num_tokens)
        self._publish_stats()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._stopped = threading.Event()
        self._idle = threading.Event()  # set while the thread waits with nothing to do
        self._num_unapplied = 0  # commands submitted and not yet applied; under _count_lock
        self._count_lock = threading.Lock()
        self.fatal_error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(queue.Full):
            self.inbox.put_nowait(None)
        self._thread.join(timeout=10)

    @property
    def is_idle(self) -> bool:
        """No request queued or running and no command waiting; its rows were handed over."""
        return self._idle.is_set() and self._num_unapplied == 0

    # ---- loop side ---------------------------------------------------------------

    def add_request(self, req: Req) -> concurrent.futures.Future[None] | None:
        """Accept ``req`` or raise (INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED).
        Never waits for the engine: an accepted request joins the next step. A request
        in a session depends on the session's state, which only the engine thread reads:
        for it the answer is the returned future, resolved once the engine applied it."""
        self.scheduler.validate(req)
        self.live.claim(req.rid)
        # Accepted now: the wait for the engine's next step is queueing, not dispatch.
        req.times.queued = time.time()
        done: concurrent.futures.Future[None] | None = None
        if req.session is not None:
            done = concurrent.futures.Future()
        try:
            self._submit(AddCommand(req, done))
        except ResourceExhaustedError:
            self.live.release(req.rid)
            raise
        return done

    def open_session(
        self, session_id: str, capacity: int, owner: str
    ) -> concurrent.futures.Future[None]:
        """Queue opening a session; the future resolves on the engine thread."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(OpenSessionCommand(session_id, capacity, owner, done))
        return done

    def close_session(self, session_id: str) -> concurrent.futures.Future[None]:
        """Queue closing a session (aborting its running requests, unpinning its KV)."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(CloseSessionCommand(session_id, done))
        return done

    def abort(self, rid: str, reason: str) -> bool:
        """Ask the engine to end ``rid``; False when it is unknown or already being aborted."""
        if not self.live.mark_aborting(rid):
            return False
        try:
            self._submit(AbortCommand(rid, reason))
        except ResourceExhaustedError:
            self.live.unmark_aborting(rid)
            raise
        return True

    def abort_started(self, reason: str) -> None:
        """Abort every live request whose first row has been sent downstream."""
        self._submit(AbortStartedCommand(reason))

    def abort_owned(self, owner: str, reason: str) -> None:
        """Abort every request ``owner`` sent, those still in the inbox included (the
        inbox is FIFO, so they are in the engine by the time this applies)."""
        self._submit(AbortOwnedCommand(owner, reason))

    def flush_cache(self) -> concurrent.futures.Future[FlushOutcome]:
        """Queue a flush; the future resolves on the engine thread, between steps, after
        every command submitted before it (so a request accepted earlier counts)."""
        done: concurrent.futures.Future[FlushOutcome] = concurrent.futures.Future()
        self._submit(FlushCommand(done))
        return done

    def _submit(self, command: Command) -> None:
        """Non-blocking; RESOURCE_EXHAUSTED when the inbox is full."""
        with self._count_lock:
            self._num_unapplied += 1
        try:
            self.inbox.put_nowait(command)
        except queue.Full:
            self._applied()
            raise ResourceExhaustedError("scheduler inbox is full, retry later") from None

    def _applied(self) -> None:
        with self._count_lock:
            self._num_unapplied -= 1

    # ---- engine thread -------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_inbox(block=not self.scheduler.has_work)
                if self.scheduler.has_work:
                    self._step()
        except BaseException as exc:  # the thread must report, not vanish
            logger.exception("engine loop crashed")
            self.fatal_error = exc
            raise

    def _step(self) -> None:
        rows = self.scheduler.step()
        self._publish_stats()
        stats = self.scheduler.take_stats()  # taken even if unused: it grows
        if self.on_stats is not None:
            self.on_stats(stats)
        for row in rows:
            if row.finish is not None:
                self.live.release(row.rid)
        if rows:
            self.sink(rows)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                if block:
                    self._idle.set()
                    command = self.inbox.get(timeout=0.5)
                else:
                    command = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._idle.clear()
            block = False
            if command is None:
                return
            self._apply(command)
            self._applied()

    def _apply(self, command: Command) -> None:
        if isinstance(command, AbortCommand):
            self.scheduler.abort(command.rid, command.reason)
        elif isinstance(command, AbortStartedCommand):
            for req in list(self.scheduler.reqs.values()):
                if req.sent_init:
                    self.scheduler.abort(req.rid, command.reason)
        elif isinstance(command, FlushCommand):
            command.done.set_result(self._flush())
        elif isinstance(command, AbortOwnedCommand):
            self._abort_owned(command.owner, command.reason)
        elif isinstance(command, OpenSessionCommand | CloseSessionCommand):
            self._apply_session(command)
        else:
            self._add(command)

    def _add(self, command: AddCommand) -> None:
        req = command.req
        try:
            self.scheduler.add_request(req)
        except TokenlineError as exc:
            if command.done is None:  # the loop side checked; tell the client anyway
                logger.warning("engine refused rid=%s (label %s): %s", req.rid, req.label, exc)
                self.scheduler.refuse(req, str(exc))
            else:  # the RPC is still waiting: the refusal is its answer, no row follows
                self.live.release(req.rid)
                _answer(command.done, exc)
            return
        if command.done is not None:
            _answer(command.done, None)

    def _abort_owned(self, owner: str, reason: str) -> None:
        """``owner``'s lease ended: its requests are aborted and its sessions closed."""
        owned = [r for r in self.scheduler.reqs.values() if r.flags.reply_to == owner]
        for req in owned:
            self.scheduler.abort(req.rid, reason)
        if owned:
            logger.warning("aborted %d requests: %s", len(owned), reason)
        num_closed = self.scheduler.close_sessions_of(owner, reason)
        if num_closed:
            logger.warning("closed %d sessions: %s", num_closed, reason)
            self._publish_stats()

    def _apply_session(self, command: OpenSessionCommand | CloseSessionCommand) -> None:
        try:
            if isinstance(command, OpenSessionCommand):
                self.scheduler.open_session(command.session_id, command.capacity, command.owner)
            else:
                self.scheduler.close_session(command.session_id)
        except TokenlineError as exc:
            _answer(command.done, exc)
            return
        self._publish_stats()  # the session count and the pinned KV changed
        _answer(command.done, None)

    def _flush(self) -> FlushOutcome:
        s = self.scheduler
        num_running, num_waiting = len(s.running), len(s.waiting)
        if num_running or num_waiting:
            reason = f"{num_running} running, {num_waiting} waiting"
            return FlushOutcome(False, num_running, num_waiting, reason)
        if not s.flush_cache():
            return FlushOutcome(False, 0, 0, "cached prefixes are pinned (open sessions)")
        logger.info("prefix cache flushed")
        self._publish_stats()  # the cached-token gauge dropped
        return FlushOutcome(True, 0, 0)

    def _publish_stats(self) -> None:
        s = self.scheduler
        self.stats = EngineStats(
            num_waiting=len(s.waiting),
            num_running=len(s.running),
            num_free_kv_tokens=s.kv_pool.num_free,
            num_total_kv_tokens=s.kv_pool.num_tokens,
            num_cached_kv_tokens=s.kv.num_cached,
            num_evictable_kv_tokens=s.kv.num_evictable,
            num_sessions=len(s.sessions),
        )


def _answer(done: concurrent.futures.Future[None], error: TokenlineError | None) -> None:
    """Resolve a waiting RPC's future; one whose caller gave up is left alone."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
