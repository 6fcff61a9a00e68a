"""The engine side of the boundary: the only loop that drives ``Scheduler`` (commands
touch it only through their ``apply``, called here).

``EngineCore.run`` drains the inbox between steps, steps while there is work, and
emits an ``EngineOutput`` after the commands it applied and after each step: plain
data (``OutputRow``s, counts, gauges, answers), no protobuf. It runs on the engine
thread (``engine_thread.py``) or as the main loop of the engine process
(``engine_process.py``); which one is only a matter of what ``inbox`` and ``emit`` are.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Protocol

from services.common.errors import TokenlineError
from services.scheduler.core.commands import NO_TICKET, EngineCommand, Ticketed
from services.scheduler.core.messages import Answer, EngineOutput, EngineStats
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.stats import SchedulerStats

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle engine blocks on its inbox before checking ``stopped``


class Inbox(Protocol):
    """``queue.Queue`` (the engine thread's) or the engine process's pipe reader: both
    raise ``queue.Empty`` when nothing came."""

    def get(self, block: bool = True, timeout: float | None = None) -> Ticketed | None: ...

    def get_nowait(self) -> Ticketed | None: ...


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
        self.emit(self._output(rows=tuple(rows), stats=stats))

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
            self.apply(*command)
            num_applied += 1
        if num_applied:
            self.emit(self._output(num_applied=num_applied))
        return keep_going

    def apply(self, ticket: int, command: EngineCommand) -> None:
        """Apply one command; its answer (or refusal) goes out under ``ticket`` with the
        next output, or, when nobody waits (``NO_TICKET``), a refusal to ``refused``."""
        try:
            answer = command.apply(self.scheduler)
        except TokenlineError as exc:
            if ticket == NO_TICKET:
                command.refused(self.scheduler, exc)
            else:
                self._answers.append((ticket, exc))
            return
        if ticket != NO_TICKET:
            self._answers.append((ticket, answer))

    def _output(
        self,
        num_applied: int = 0,
        rows: tuple[OutputRow, ...] = (),
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
