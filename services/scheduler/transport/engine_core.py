"""The engine side of the boundary: the only code that touches ``Scheduler`` and ``Req``.

``EngineCore.run`` drains the inbox between steps, steps while there is work, and
emits an ``EngineOutput`` after the commands it applied and after each step. It runs
on the engine thread (``engine_thread.py``) or as the main loop of the engine process
(``engine_process.py``); which one is only a matter of what ``inbox`` and ``emit`` are.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Protocol

from tokenline.v1 import scheduler_pb2

from services.common.errors import TokenlineError
from services.scheduler.core.messages import (
    NO_TICKET,
    AbortCommand,
    AbortOwnedCommand,
    AbortStartedCommand,
    AddCommand,
    Answer,
    CloseSessionCommand,
    Command,
    EngineOutput,
    EngineStats,
    FlushCommand,
    FlushOutcome,
    OpenSessionCommand,
)
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.stats import SchedulerStats
from services.scheduler.transport.proto_codec import row_to_pb

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle engine blocks on its inbox before checking ``stopped``


class Inbox(Protocol):
    """``queue.Queue`` (the engine thread's) or the engine process's pipe reader: both
    raise ``queue.Empty`` when nothing came."""

    def get(self, block: bool = True, timeout: float | None = None) -> Command | None: ...

    def get_nowait(self) -> Command | None: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, emit: Callable[[EngineOutput], None]) -> None:
        self.scheduler = scheduler
        self.emit = emit  # may block: that is the RPC side's backpressure
        self._answers: list[tuple[int, Answer]] = []

    def run(self, inbox: Inbox, stopped: Callable[[], bool]) -> None:
        """Serve until ``stopped()`` or a ``None`` command."""
        while not stopped():
            if not self._drain(inbox, block=not self.scheduler.has_work):
                return
            if self.scheduler.has_work:
                self.step()

    def step(self) -> None:
        rows = self.scheduler.step()
        stats = self.scheduler.take_stats()  # taken every step: it grows
        self.emit(self._output(rows=tuple(map(row_to_pb, rows)), stats=stats))

    def publish(self) -> None:
        """Emit the engine's state with nothing else: its first output."""
        self.emit(self._output())

    def _drain(self, inbox: Inbox, block: bool) -> bool:
        """Apply every queued command (waiting for one when ``block``); False on ``None``."""
        num_applied = 0
        keep_going = True
        while True:
            try:
                command = inbox.get(timeout=IDLE_WAIT_S) if block else inbox.get_nowait()
            except queue.Empty:
                break
            block = False
            if command is None:
                keep_going = False
                break
            self.apply(command)
            num_applied += 1
        if num_applied:
            self.emit(self._output(num_applied=num_applied))
        return keep_going

    def apply(self, command: Command) -> None:
        s = self.scheduler
        if isinstance(command, AbortCommand):
            s.abort(command.rid, command.reason)
        elif isinstance(command, AbortStartedCommand):
            for req in list(s.reqs.values()):
                if req.sent_init:
                    s.abort(req.rid, command.reason)
        elif isinstance(command, FlushCommand):
            self._answers.append((command.ticket, self._flush()))
        elif isinstance(command, AbortOwnedCommand):
            self._abort_owned(command.owner, command.reason)
        elif isinstance(command, OpenSessionCommand):
            args = (command.session_id, command.capacity, command.owner)
            self._answer(command.ticket, s.open_session, *args)
        elif isinstance(command, CloseSessionCommand):
            self._answer(command.ticket, s.close_session, command.session_id)
        else:
            self._add(command)

    def _add(self, command: AddCommand) -> None:
        req = command.req
        try:
            self.scheduler.add_request(req)
        except TokenlineError as exc:
            if command.ticket == NO_TICKET:  # the RPC side accepted it; tell the client anyway
                logger.warning("engine refused rid=%s (label %s): %s", req.rid, req.label, exc)
                self.scheduler.refuse(req, str(exc))
            else:  # the RPC still waits: the refusal is its answer, no row follows
                self._answers.append((command.ticket, exc))
            return
        if command.ticket != NO_TICKET:
            self._answers.append((command.ticket, None))

    def _answer(self, ticket: int, apply: Callable[..., object], *args: object) -> None:
        try:
            apply(*args)
        except TokenlineError as exc:
            self._answers.append((ticket, exc))
            return
        self._answers.append((ticket, None))

    def _abort_owned(self, owner: str, reason: str) -> None:
        """``owner``'s lease ended: its requests are aborted and its sessions closed."""
        s = self.scheduler
        owned = [r for r in s.reqs.values() if r.flags.reply_to == owner]
        for req in owned:
            s.abort(req.rid, reason)
        if owned:
            logger.warning("aborted %d requests: %s", len(owned), reason)
        num_closed = s.close_sessions_of(owner, reason)
        if num_closed:
            logger.warning("closed %d sessions: %s", num_closed, reason)

    def _flush(self) -> FlushOutcome:
        s = self.scheduler
        num_running, num_waiting = len(s.running), len(s.waiting)
        if num_running or num_waiting:
            reason = f"{num_running} running, {num_waiting} waiting"
            return FlushOutcome(False, num_running, num_waiting, reason)
        if not s.flush_cache():
            return FlushOutcome(False, 0, 0, "cached prefixes are pinned (open sessions)")
        logger.info("prefix cache flushed")
        return FlushOutcome(True, 0, 0)

    def _output(
        self,
        num_applied: int = 0,
        rows: tuple[scheduler_pb2.TokenIDRow, ...] = (),
        stats: SchedulerStats | None = None,
    ) -> EngineOutput:
        answers, self._answers = tuple(self._answers), []
        s = self.scheduler
        engine_stats = EngineStats(
            num_waiting=len(s.waiting),
            num_running=len(s.running),
            num_free_kv_tokens=s.kv_pool.num_free,
            num_total_kv_tokens=s.kv_pool.num_tokens,
            num_cached_kv_tokens=s.kv.num_cached,
            num_evictable_kv_tokens=s.kv.num_evictable,
            num_sessions=len(s.sessions),
        )
        return EngineOutput(engine_stats, not s.has_work, num_applied, answers, rows, stats)
