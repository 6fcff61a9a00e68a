"""Runs the Scheduler on its own thread; the gRPC side talks to it via queues.

The event loop never waits on a forward pass: commands go in through a bounded
inbox, per-step outputs come out through a bounded outbox that the transport
drains. Torch releases the GIL during kernels, so both sides make progress.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import ResourceExhaustedError, TokenlineError
from services.scheduler.engine import OutputRow, Scheduler
from services.scheduler.req import Req
from services.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AddCommand:
    req: Req
    done: Callable[[TokenlineError | None], None]


@dataclass(slots=True)
class AbortCommand:
    rid: str
    reason: str
    done: Callable[[bool], None]


@dataclass(slots=True)
class EngineStats:
    """A snapshot published after every step; read from any thread."""

    num_waiting: int = 0
    num_running: int = 0
    num_free_kv_tokens: int = 0
    num_total_kv_tokens: int = 0
    num_cached_kv_tokens: int = 0  # in the prefix cache, shared or evictable
    num_evictable_kv_tokens: int = 0  # cached and held by no request
    num_steps: int = 0
    num_retractions: int = 0


class EngineThread:
    def __init__(
        self,
        scheduler: Scheduler,
        inbox_size: int = 8192,
        outbox_size: int = 256,
        on_stats: Callable[[SchedulerStats], None] | None = None,
    ):
        self.scheduler = scheduler
        self.on_stats = on_stats  # gets the engine's counts after every step, on this thread
        self.inbox: queue.Queue[AddCommand | AbortCommand | None] = queue.Queue(inbox_size)
        self.outbox: queue.Queue[list[OutputRow]] = queue.Queue(outbox_size)
        self.stats = EngineStats(num_total_kv_tokens=scheduler.kv_pool.num_tokens)
        self._publish_stats()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._stopped = threading.Event()
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
        """No request queued or running and no output waiting to be sent."""
        return not self.scheduler.has_work and self.inbox.empty() and self.outbox.empty()

    def abort_started(self, reason: str) -> None:
        """Abort every live request whose first row has been sent downstream."""
        for req in list(self.scheduler.reqs.values()):
            if req.sent_init:
                self.submit(AbortCommand(req.rid, reason, lambda _found: None))

    def submit(self, command: AddCommand | AbortCommand) -> None:
        """Non-blocking; RESOURCE_EXHAUSTED when the inbox is full."""
        try:
            self.inbox.put_nowait(command)
        except queue.Full:
            raise ResourceExhaustedError("scheduler inbox is full, retry later") from None

    def _loop(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_inbox(block=not self.scheduler.has_work)
                if self.scheduler.has_work:
                    rows = self.scheduler.step()
                    self._publish_stats()
                    stats = self.scheduler.take_stats()  # taken even if unused: it grows
                    if self.on_stats is not None:
                        self.on_stats(stats)
                    if rows:
                        self.outbox.put(rows)
        except BaseException as exc:  # the thread must report, not vanish
            logger.exception("engine loop crashed")
            self.fatal_error = exc
            raise

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                command = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if command is None:
                return
            self._apply(command)

    def _apply(self, command: AddCommand | AbortCommand) -> None:
        if isinstance(command, AbortCommand):
            command.done(self.scheduler.abort(command.rid, command.reason))
            return
        try:
            self.scheduler.add_request(command.req)
        except TokenlineError as exc:
            command.done(exc)
        else:
            command.done(None)

    def _publish_stats(self) -> None:
        s = self.scheduler
        self.stats = EngineStats(
            num_waiting=len(s.waiting),
            num_running=len(s.running),
            num_free_kv_tokens=s.kv_pool.num_free,
            num_total_kv_tokens=s.kv_pool.num_tokens,
            num_cached_kv_tokens=s.kv.num_cached,
            num_evictable_kv_tokens=s.kv.num_evictable,
            num_steps=s.num_steps,
            num_retractions=s.num_retractions,
        )
