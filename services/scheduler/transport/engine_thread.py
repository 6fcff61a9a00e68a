"""The engine on a thread of the gRPC process: what tests and in-process tools use.

Commands go through a ``queue.Queue``; the engine thread runs ``EngineCore`` and
delivers its outputs to ``EngineClient.handle`` directly. Only the engine thread
touches ``Scheduler`` and ``Req``; rows cross as ``OutputRow`` snapshots.
Torch releases the GIL during kernels, so both sides progress, but each one's Python
waits for the other's: the server runs the engine in its own process instead
(``engine_process.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.stats import SchedulerStats
from services.scheduler.transport.engine_client import EngineClient, RowSink
from services.scheduler.transport.engine_core import EngineCore

logger = logging.getLogger(__name__)


class EngineThread(EngineClient):
    def __init__(
        self,
        scheduler: Scheduler,
        sink: RowSink,
        inbox_size: int = 8192,
        on_stats: Callable[[SchedulerStats], None] | None = None,
        on_fatal: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(scheduler.limits, sink, on_stats, on_fatal, inbox_size)
        self.scheduler = scheduler
        self._core = EngineCore(scheduler, emit=self.handle)
        self._core.publish()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopped = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._ask_to_stop()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            self._core.run(self.inbox, self._stopped.is_set)
        except BaseException as exc:  # the thread must report, not vanish
            logger.exception("engine loop crashed")
            self._failed(exc)
            raise
