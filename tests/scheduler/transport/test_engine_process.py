"""The engine in its own process: commands, rows and answers cross the process boundary
intact, the child stops when told, never outlives its parent, and its death is reported.

A real child (spawned: pytest has run torch kernels, which ``fork`` must not follow)
loading the default model; the parent-death check runs the real scheduler, which forks."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from services.common.errors import InvalidArgumentError
from services.scheduler.__main__ import parse_args
from services.scheduler.core.commands import CloseSessionCommand, FlushCommand
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import SessionParams
from services.scheduler.transport.engine_process import EngineLaunch, EngineProcess
from tests.scheduler.factories import make_req, make_scheduler

pytestmark = pytest.mark.live

PROMPT = [0, *range(1000, 1040)]
KV_TOKENS = 4096


class Rows:
    """The sink: every row the engine process handed over, by rid."""

    def __init__(self) -> None:
        self.rows: queue.Queue[OutputRow] = queue.Queue()

    def __call__(self, batch: Sequence[OutputRow]) -> None:
        for row in batch:
            self.rows.put(row)

    def until_final(self, rid: str) -> list[OutputRow]:
        got: list[OutputRow] = []
        while True:
            row = self.rows.get(timeout=60)
            if row.rid == rid:
                got.append(row)
                if row.finish is not None:
                    return got


def _launch(model_dir: Path, sink: Rows, on_fatal=None) -> EngineProcess:
    config = parse_args(
        ["--model", str(model_dir), "--dtype", "float32", "--kv-cache-tokens", str(KV_TOKENS)]
    )
    launch = EngineLaunch(config, start_method="spawn")
    engine = asyncio.run(launch.ready(sink, on_fatal=on_fatal))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(default_model_dir: Path) -> Iterator[tuple[EngineProcess, Rows]]:
    rows = Rows()
    engine = _launch(default_model_dir, rows)
    yield engine, rows
    engine.stop()


def test_a_request_gives_the_same_tokens_as_the_engine_in_process(
    engine: tuple[EngineProcess, Rows], default_model_dir: Path
) -> None:
    process, rows = engine
    assert process.pid != os.getpid()
    assert process.limits.num_kv_tokens == KV_TOKENS == process.stats.num_total_kv_tokens
    process.add_request(make_req("a", PROMPT, temperature=0.0, max_new_tokens=6))
    got = rows.until_final("a")
    tokens = [t for row in got for t in row.new_token_ids]

    local = make_scheduler(default_model_dir)
    local.add_request(make_req("a", PROMPT, temperature=0.0, max_new_tokens=6))
    expected: list[int] = []
    while local.has_work:
        expected += [t for row in local.step() for t in row.new_token_ids]
    assert tokens == expected and len(tokens) == 6
    assert got[-1].finish is not None and got[-1].finish.kind == "length"
    # The final row released the rid, and the engine reported itself idle after it.
    assert len(process.live) == 0
    deadline = time.monotonic() + 30
    while not process.is_idle:
        assert time.monotonic() < deadline, "the engine never reported idle"
        time.sleep(0.01)
    assert process.stats.num_running == process.stats.num_waiting == 0


def test_answers_and_refusals_cross_with_their_type_and_field(
    engine: tuple[EngineProcess, Rows],
) -> None:
    process, rows = engine
    with pytest.raises(InvalidArgumentError) as refused:
        process.ask(CloseSessionCommand("no-such-session")).result(timeout=30)
    assert refused.value.field == "session_id"

    # A session request is answered by the engine; refused, its rid is free again.
    req = make_req("s1", PROMPT, max_new_tokens=2)
    req.session = SessionParams("no-such-session")
    done = process.add_request(req)
    assert done is not None
    with pytest.raises(InvalidArgumentError):
        done.result(timeout=30)
    assert len(process.live) == 0

    process.add_request(make_req("warm", PROMPT, temperature=0.0, max_new_tokens=1))
    rows.until_final("warm")
    outcome = process.ask(FlushCommand()).result(timeout=30)
    assert outcome.flushed and (outcome.num_running, outcome.num_waiting) == (0, 0)
    assert process.stats.num_cached_kv_tokens == 0


def test_an_abort_ends_a_running_request_in_the_child(engine: tuple[EngineProcess, Rows]) -> None:
    process, rows = engine
    process.add_request(make_req("long", PROMPT, max_new_tokens=3000, ignore_eos=True))
    first = rows.rows.get(timeout=60)
    assert first.rid == "long" and first.finish is None  # it runs
    assert process.abort("long", "client left")
    final = rows.until_final("long")[-1]
    assert final.finish is not None and final.finish.kind == "abort"


def test_a_dead_engine_process_is_reported(default_model_dir: Path) -> None:
    fatal = threading.Event()
    process = _launch(default_model_dir, Rows(), on_fatal=fatal.set)
    try:
        assert process.fatal_error is None
        os.kill(process.pid, signal.SIGKILL)
        assert fatal.wait(timeout=30), "on_fatal was never called"
        assert "exited" in str(process.fatal_error)
    finally:
        process.stop()


def test_the_engine_process_dies_with_the_scheduler(
    default_model_dir: Path, tmp_path: Path
) -> None:
    log = (tmp_path / "scheduler.log").open("w+")
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "services.scheduler", "--model", str(default_model_dir),
         "--port", "0", "--kv-cache-tokens", str(KV_TOKENS)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "engine process" not in Path(log.name).read_text():
            assert scheduler.poll() is None, Path(log.name).read_text()
            assert time.monotonic() < deadline, "the engine process never became ready"
            time.sleep(0.1)
        children = Path(f"/proc/{scheduler.pid}/task/{scheduler.pid}/children").read_text()
        (engine_pid,) = [int(pid) for pid in children.split()]
        assert _alive(engine_pid)
        scheduler.kill()  # SIGKILL: no drain, no stop command
        scheduler.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(engine_pid):
            assert time.monotonic() < deadline, "the engine process outlived the scheduler"
            time.sleep(0.05)
    finally:
        if scheduler.poll() is None:
            scheduler.kill()
            scheduler.wait()
        log.close()


def _alive(pid: int) -> bool:
    """Running or sleeping; a zombie waiting to be reaped counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
