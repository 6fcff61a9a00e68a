"""The engine in its own process, as SGLang runs its scheduler.

On a thread of the gRPC process the engine's Python (the code between kernels, and
the sampler) and the event loop's (protobuf, gRPC callbacks) share one GIL: under load
py-spy found the engine thread waiting for it 18 % of the time while a core sat idle.
Here the gRPC process keeps only the RPC side (``EngineClient``) and the engine runs
``EngineCore`` in a child process that loads the model itself.

* The child is forked before the gRPC process starts any thread (``EngineLaunch``), so
  it starts with every module imported, and loads the model while gRPC starts.
* Both directions are frames on a private pipe: the boundary's own typed messages as
  Protobuf, written and read by the generic ``engine_codec.py``.
* Commands: the RPC side puts them on a bounded ``queue.Queue`` and a sender thread
  encodes and writes them, so an RPC never waits for a busy engine; the engine reads
  what has arrived between steps.
* Outputs: a reader thread decodes each and hands it to ``EngineClient.handle``. While
  the detokenizer lags, the sink blocks the reader, the pipe fills and the engine's
  write waits: the same backpressure as on a thread.
* The child never outlives the gRPC process (``PR_SET_PDEATHSIG``, also after a
  ``kill -9``) and ignores SIGINT/SIGTERM: the gRPC process drains, then stops it.
  If the child dies, ``fatal_error`` is set and ``on_fatal`` runs, so the scheduler
  exits and its supervisor restarts the pair.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from services.common.logs import setup_logging
from services.scheduler.core.commands import Ticketed
from services.scheduler.core.messages import EngineLimits, EngineOutput
from services.scheduler.core.stats import SchedulerStats
from services.scheduler.transport.engine_build import SchedulerProcessConfig, build_scheduler
from services.scheduler.transport.engine_client import EngineClient, RowSink
from services.scheduler.transport.engine_codec import decode, encode
from services.scheduler.transport.engine_core import EngineCore

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1


class EngineLaunch:
    """A started engine child that may still be loading its model.

    ``start_method``: ``fork`` (the server's: the child inherits the imported modules,
    so it starts at once) must run before this process made threads or ran a torch
    kernel; ``spawn`` is safe anywhere and re-imports everything (tests use it)."""

    def __init__(self, config: SchedulerProcessConfig, start_method: str = "fork") -> None:
        context: Any = multiprocessing.get_context(start_method)  # typeshed lacks .Process
        child_commands, self.commands = context.Pipe(duplex=False)  # (receiver, sender)
        self.outputs, child_outputs = context.Pipe(duplex=False)
        # Started from this thread: the parent-death signal follows the thread that forks.
        self.process = context.Process(
            target=run_engine,
            args=(config, child_commands, child_outputs, os.getpid()),
            name="tokenline-engine",
            daemon=True,
        )
        self.process.start()
        child_commands.close()
        child_outputs.close()

    async def ready(
        self,
        sink: RowSink,
        on_stats: Callable[[SchedulerStats], None] | None = None,
        on_fatal: Callable[[], None] | None = None,
        inbox_size: int = 8192,
    ) -> EngineProcess:
        """Wait, off the loop, until the child has loaded the model."""
        try:
            first = await asyncio.to_thread(self.outputs.recv_bytes)
        except EOFError:
            await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
            raise RuntimeError(
                f"the engine process exited while starting (exit code {self.process.exitcode})"
            ) from None
        limits, dtype = decode(first)  # the child's first frame: (EngineLimits, dtype)
        logger.info("engine process %d ready", self.process.pid)
        return EngineProcess(self, limits, dtype, sink, on_stats, on_fatal, inbox_size)


class EngineProcess(EngineClient):
    def __init__(
        self,
        launch: EngineLaunch,
        limits: EngineLimits,
        dtype: str,
        sink: RowSink,
        on_stats: Callable[[SchedulerStats], None] | None = None,
        on_fatal: Callable[[], None] | None = None,
        inbox_size: int = 8192,
    ) -> None:
        super().__init__(limits, sink, on_stats, on_fatal, inbox_size)
        self.dtype = dtype  # what the model runs in
        self._process = launch.process
        self._commands = launch.commands
        self._outputs = launch.outputs
        self._stopping = False
        self._sender = threading.Thread(target=self._send, name="engine-sender", daemon=True)
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    def start(self) -> None:
        self._sender.start()
        self._reader.start()

    def stop(self) -> None:
        """Ask the child to finish (after the commands queued before), then make sure."""
        self._stopping = True
        self._ask_to_stop()
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            logger.warning("engine process did not stop; killing it")
            self._process.kill()
            self._process.join(STOP_TIMEOUT_S)
        self._reader.join(STOP_TIMEOUT_S)

    def _send(self) -> None:
        try:
            while True:
                command = self.inbox.get()
                self._commands.send_bytes(encode(command))
                if command is None:
                    return
        except OSError:  # the child is gone; the reader reports it
            return

    def _read(self) -> None:
        try:
            while True:
                self.handle(decode(self._outputs.recv_bytes()))
        except (EOFError, OSError):
            pass
        if self._stopping:
            return
        self._process.join(1.0)
        error = RuntimeError(
            f"engine process {self._process.pid} exited (exit code {self._process.exitcode})"
        )
        logger.error("%s", error)
        self._failed(error)


class _PipeInbox:
    """The engine's side of the command pipe, as ``EngineCore.run`` reads an inbox."""

    def __init__(self, commands: Connection) -> None:
        self._commands = commands

    def get(self, block: bool = True, timeout: float | None = None) -> Ticketed | None:
        if not self._commands.poll(timeout if block else 0):
            raise queue.Empty
        try:
            command: Ticketed | None = decode(self._commands.recv_bytes())
            return command
        except EOFError:  # the gRPC process went away
            return None

    def get_nowait(self) -> Ticketed | None:
        return self.get(block=False)


def run_engine(
    config: SchedulerProcessConfig, commands: Connection, outputs: Connection, parent_pid: int
) -> None:
    """The child's main: load the model, report ready, serve commands until told to stop."""
    _die_with_parent(parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    setup_logging(config.log_level, config.log_json)
    scheduler, dtype = build_scheduler(config)
    outputs.send_bytes(encode((scheduler.limits, dtype)))

    def emit(output: EngineOutput) -> None:
        outputs.send_bytes(encode(output))

    core = EngineCore(scheduler, emit)
    core.publish()
    try:
        core.run(_PipeInbox(commands), stopped=lambda: False)
    except BrokenPipeError:
        return  # the gRPC process went away
    except BaseException:
        logger.exception("engine loop crashed")
        raise
    finally:
        outputs.close()


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the gRPC process ends, however it ends (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os._exit(1)
