"""FlushCommand: the prefix cache is emptied on the engine thread, and only when idle."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.scheduler.core.commands import FlushCommand
from services.scheduler.core.output_row import OutputRow
from services.scheduler.transport.engine_thread import EngineThread
from tests.scheduler.factories import make_req, make_scheduler

PROMPT = list(range(100, 164))


@pytest.fixture
def engine(default_model_dir: Path) -> Iterator[tuple[EngineThread, queue.Queue[OutputRow]]]:
    rows: queue.Queue[OutputRow] = queue.Queue()
    engine = EngineThread(make_scheduler(default_model_dir), lambda batch: [*map(rows.put, batch)])
    engine.start()
    yield engine, rows
    engine.stop()


def _final(rows: queue.Queue[OutputRow], rid: str) -> OutputRow:
    while True:
        row = rows.get(timeout=60)
        if row.rid == rid and row.finish is not None:
            return row


def test_flush_is_refused_while_a_request_runs_and_empties_the_cache_after(
    engine: tuple[EngineThread, queue.Queue[OutputRow]],
) -> None:
    thread, rows = engine
    thread.add_request(make_req("warm", PROMPT, max_new_tokens=2, temperature=0.0))
    _final(rows, "warm")
    assert thread.scheduler.kv.num_cached > 0  # the finished prompt stays cached

    thread.add_request(make_req("long", PROMPT, max_new_tokens=3000, ignore_eos=True))
    busy = thread.ask(FlushCommand()).result(timeout=30)  # FIFO: "long" is in the engine by now
    assert not busy.flushed and busy.num_running + busy.num_waiting == 1
    assert thread.scheduler.kv.num_cached > 0

    thread.abort("long", "test")
    _final(rows, "long")
    done = thread.ask(FlushCommand()).result(timeout=30)
    assert done.flushed and (done.num_running, done.num_waiting) == (0, 0)
    assert thread.stats.num_cached_kv_tokens == 0
