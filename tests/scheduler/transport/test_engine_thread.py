"""The engine thread's boundary: RPC-side calls never wait for a step, and what crosses
the thread boundary is a snapshot, never a live ``Req``."""

from __future__ import annotations

import queue
import threading
import time
import typing
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from services.scheduler.core.output_row import OutputRow, RowInit
from services.scheduler.core.req import Req
from services.scheduler.transport.engine_thread import EngineThread
from services.scheduler.transport.proto_codec import row_to_pb
from tests.scheduler.factories import make_req, make_scheduler

PROMPT = [0, *range(1000, 1040)]


class GatedSink:
    """Collects rows; while closed, the engine thread blocks inside it (mid-step)."""

    def __init__(self) -> None:
        self.rows: queue.Queue[OutputRow] = queue.Queue()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __call__(self, rows: Sequence[OutputRow]) -> None:
        self.entered.set()
        self.gate.wait(timeout=60)
        for row in rows:
            self.rows.put(row)

    def finals(self, rids: set[str]) -> dict[str, OutputRow]:
        found: dict[str, OutputRow] = {}
        while not rids <= found.keys():
            row = self.rows.get(timeout=60)
            if row.finish is not None:
                found[row.rid] = row
        return found


@pytest.fixture
def gated(default_model_dir: Path) -> typing.Iterator[tuple[EngineThread, GatedSink]]:
    sink = GatedSink()
    engine = EngineThread(make_scheduler(default_model_dir, max_running_requests=4), sink)
    engine.start()
    yield engine, sink
    sink.gate.set()
    engine.stop()


def test_add_and_abort_answer_while_the_engine_is_stuck_in_a_step(gated: tuple) -> None:
    engine, sink = gated
    engine.add_request(make_req("first", PROMPT, temperature=0.0, max_new_tokens=3))
    assert sink.entered.wait(timeout=60)  # the engine thread is now blocked mid-step
    # Each call returns with the engine still blocked: nothing here waits for a step.
    engine.add_request(make_req("second", PROMPT, temperature=0.0, max_new_tokens=3))
    with pytest.raises(AlreadyExistsError):
        engine.add_request(make_req("second", PROMPT, max_new_tokens=3))
    with pytest.raises(InvalidArgumentError):
        engine.add_request(make_req("bad", [10**9], max_new_tokens=3))
    engine.add_request(make_req("doomed", PROMPT, max_new_tokens=50))
    assert engine.abort("doomed", "client left")
    assert not engine.abort("doomed", "again")  # already being aborted
    assert not engine.abort("never-seen", "x")
    assert not sink.gate.is_set()
    sink.gate.set()
    finals = sink.finals({"first", "second", "doomed"})
    assert {rid: row.finish.kind for rid, row in finals.items()} == {
        "first": "length",
        "second": "length",
        "doomed": "abort",
    }
    # Final rows released the rids: the same ids may be used again.
    engine.add_request(make_req("second", PROMPT, temperature=0.0, max_new_tokens=1))
    assert sink.finals({"second"})["second"].finish.kind == "length"


def test_a_full_scheduler_refuses_at_once_and_frees_the_slot_when_a_request_ends(
    default_model_dir: Path,
) -> None:
    sink = GatedSink()
    scheduler = make_scheduler(default_model_dir, max_waiting_requests=2)
    engine = EngineThread(scheduler, sink)
    engine.start()
    try:
        engine.add_request(make_req("a", PROMPT, temperature=0.0, max_new_tokens=2))
        assert sink.entered.wait(timeout=60)  # "a" runs; the engine is blocked mid-step
        engine.add_request(make_req("b", PROMPT, temperature=0.0, max_new_tokens=2))
        with pytest.raises(ResourceExhaustedError):  # live = running + waiting = 2
            engine.add_request(make_req("c", PROMPT, max_new_tokens=2))
        sink.gate.set()
        assert {r.finish.kind for r in sink.finals({"a", "b"}).values()} == {"length"}
        engine.add_request(make_req("c", PROMPT, temperature=0.0, max_new_tokens=1))
        assert sink.finals({"c"})["c"].finish.kind == "length"
    finally:
        sink.gate.set()
        engine.stop()


def test_an_abort_refused_for_a_full_inbox_can_be_sent_again(default_model_dir: Path) -> None:
    sink = GatedSink()
    sink.gate.set()
    engine = EngineThread(make_scheduler(default_model_dir), sink, inbox_size=1)  # not started
    try:
        engine.add_request(make_req("a", PROMPT, max_new_tokens=500))  # fills the inbox
        with pytest.raises(ResourceExhaustedError):
            engine.abort("a", "client left")
        engine.start()
        deadline = time.monotonic() + 30
        while not engine.inbox.empty():  # the engine takes "a" out of the one-slot inbox
            assert time.monotonic() < deadline, "the engine never drained its inbox"
            time.sleep(0.01)
        assert engine.abort("a", "client left")  # not stuck as "already aborting"
        assert sink.finals({"a"})["a"].finish.kind == "abort"
    finally:
        engine.stop()


def test_output_rows_are_snapshots_that_share_nothing_with_the_req(
    default_model_dir: Path,
) -> None:
    scheduler = make_scheduler(default_model_dir)
    req = make_req("r", PROMPT, temperature=0.0, max_new_tokens=2, stop=["zz"])
    scheduler.add_request(req)
    first = scheduler.step()[0]
    assert first.init == RowInit(req.flags, tuple(PROMPT[-5:]))
    pb_before = row_to_pb(first).SerializeToString()
    second = scheduler.step()[0]
    assert second.init is None and second.finish is not None
    # The engine went on mutating the Req; the first row still says what it said.
    assert first.num_output_tokens == 1 and len(req.output_ids) == 2
    assert row_to_pb(first).SerializeToString() == pb_before
    assert second.times is not None and second.times.finished is not None
    req.times.finished = -1.0
    assert second.times.finished != -1.0
    # No field of a row can hold a Req: the transport cannot reach live engine state.
    hints = typing.get_type_hints(OutputRow)
    assert not any(_mentions(hint, Req) for hint in hints.values())


def _mentions(hint: object, cls: type) -> bool:
    return hint is cls or any(_mentions(arg, cls) for arg in typing.get_args(hint))
