"""Sessions in the scheduler core (services/scheduler/core/sessions.py) over the real default
model and radix cache: how a continuation's input is assembled, that its parent's whole
sequence stays in KV (and is pinned there) until the session closes, and every refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import AlreadyExistsError, InvalidArgumentError
from services.scheduler.core.commands import (
    AbortOwnedCommand,
    CloseSessionCommand,
    OpenSessionCommand,
)
from services.scheduler.core.req import Req, SessionParams
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.scheduler_output import ExecuteOutput, SchedulerOutput
from services.scheduler.transport.engine_thread import EngineThread
from tests.scheduler.factories import (
    assert_kv_conserved,
    assert_kv_returns_to_pool,
    make_req,
    make_scheduler,
    run_to_completion,
)
from tests.waiting import wait_until

BOS = 0  # the default model's bos_token_id
OWNER = "frontend-a"


def ids(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1000 for i in range(length)]


def turn(rid: str, own: list[int], session: SessionParams, max_new: int = 5) -> Req:
    req = make_req(rid, own, temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    req.session = session
    return req


def full(req: Req) -> list[int]:
    return req.input_ids + req.output_ids


@pytest.fixture
def scheduler(default_model_dir: Path) -> Scheduler:
    s = make_scheduler(default_model_dir)
    s.open_session("s", capacity=1000, owner=OWNER)
    return s


def run(scheduler: Scheduler, req: Req) -> Req:
    run_to_completion(scheduler, {0: [req]})
    return req


def test_a_continuation_prefills_only_its_new_tokens_and_matches_a_fresh_run(
    default_model_dir: Path, scheduler: Scheduler
) -> None:
    t1 = run(scheduler, turn("t1", [BOS, *ids(1, 9)], SessionParams("s")))
    assert t1.finish is not None and t1.finish.kind == "length"
    # The last sampled token got its K/V too: the whole sequence is cached and pinned.
    assert len(scheduler.kv.tree.match_prefix(full(t1)).slots) == len(full(t1))
    assert scheduler.kv.tree.num_locked == len(full(t1))
    t2 = run(scheduler, turn("t2", [BOS, *ids(2, 4)], SessionParams("s", rid="t1"), 6))
    assert t2.input_ids == full(t1) + ids(2, 4)  # the continuation's own BOS is dropped
    assert t2.num_cached_tokens == len(full(t1))
    fresh = make_scheduler(default_model_dir)  # no cache shared with the session
    ref = make_req("ref", t2.input_ids, temperature=0.0, max_new_tokens=6, ignore_eos=True)
    assert run(fresh, ref).output_ids == t2.output_ids
    assert fresh.kv.tree.num_locked == 0  # a request outside a session pins nothing


def test_the_last_tokens_kv_is_a_row_of_the_next_step(scheduler: Scheduler) -> None:
    """The K/V of a finished request's last token is computed by the step after, as a row
    of its plan that samples nothing; then the whole sequence is pinned."""
    outs: list[SchedulerOutput] = []
    execute = scheduler.executor.execute

    def recorded(out: SchedulerOutput, inflight_tokens: list[int] | None = None) -> ExecuteOutput:
        outs.append(out)
        return execute(out, inflight_tokens)

    scheduler.executor.execute = recorded  # type: ignore[method-assign]
    t1 = run(scheduler, turn("t1", ids(1, 9), SessionParams("s")))
    last = outs[-1]
    assert [r.rid for r in last.reqs] == ["t1"] and last.kv_only_rows == [0]
    assert last.new_token_ids == [[t1.output_ids[-1]]]
    assert last.prefix_lens == [len(full(t1)) - 1]
    assert not last.sample_rows and not last.prompt_only_rows
    assert all(0 not in out.kv_only_rows for out in outs[:-1])
    assert scheduler.kv.tree.num_locked == len(full(t1))


def finish_first_turn(scheduler: Scheduler) -> Req:
    """Session "s"'s first turn, stepped until it has finished (its last token's K/V is
    still to be computed then: a planned row of the next step)."""
    t1 = turn("t1", ids(1, 9), SessionParams("s"))
    scheduler.add_request(t1)
    while t1.finish is None:
        scheduler.step()
    return t1


def test_a_continuation_sent_before_its_parents_last_token_is_computed_waits_for_it(
    scheduler: Scheduler,
) -> None:
    t1 = finish_first_turn(scheduler)
    assert scheduler.has_work  # the last token's K/V is still to be computed
    t2 = turn("t2", ids(2, 4), SessionParams("s", rid="t1"))
    run(scheduler, t2)
    assert t2.num_cached_tokens == len(full(t1))


def test_a_session_closed_before_the_last_token_is_computed_pins_nothing(
    scheduler: Scheduler,
) -> None:
    finish_first_turn(scheduler)
    scheduler.close_session("s")
    run_to_completion(scheduler)
    assert_kv_returns_to_pool(scheduler)


def test_turns_under_overlap_scheduling_match_the_synchronous_ones(
    default_model_dir: Path, scheduler: Scheduler
) -> None:
    overlapped = make_scheduler(default_model_dir, overlap_schedule=True)
    overlapped.open_session("s", capacity=1000, owner=OWNER)
    outputs = []
    for s in (scheduler, overlapped):
        t1 = run(s, turn("t1", ids(1, 9), SessionParams("s")))
        assert s.kv.tree.num_locked == len(full(t1))
        t2 = run(s, turn("t2", ids(2, 4), SessionParams("s", rid="t1"), 6))
        assert t2.num_cached_tokens == len(full(t1))
        outputs.append((t1.output_ids, t2.output_ids))
    assert outputs[0] == outputs[1]


def test_pinned_kv_survives_eviction_and_close_returns_it(scheduler: Scheduler) -> None:
    t1 = run(scheduler, turn("t1", ids(3, 12), SessionParams("s")))
    run(scheduler, make_req("other", ids(4, 12), max_new_tokens=3))
    scheduler.kv.tree.evict(scheduler.kv_pool.num_tokens)  # everything evictable goes
    assert len(scheduler.kv.tree.match_prefix(full(t1)).slots) == len(full(t1))
    assert_kv_conserved(scheduler)
    assert not scheduler.flush_cache()  # the session's lock holds
    scheduler.close_session("s")
    assert_kv_returns_to_pool(scheduler)
    with pytest.raises(InvalidArgumentError) as err:
        scheduler.add_request(turn("t2", ids(5, 3), SessionParams("s", rid="t1")))
    assert err.value.field == "session_params.id"


def test_offset_and_drop_previous_output_cut_the_parent(scheduler: Scheduler) -> None:
    t1 = run(scheduler, turn("t1", ids(6, 8), SessionParams("s")))
    dropped = run(
        scheduler, turn("d", ids(7, 2), SessionParams("s", "t1", drop_previous_output=True))
    )
    assert dropped.input_ids == t1.input_ids + ids(7, 2)
    assert dropped.num_cached_tokens == len(t1.input_ids)
    cut = run(scheduler, turn("o", ids(8, 2), SessionParams("s", "t1", offset=10)))
    assert cut.input_ids == full(t1)[:10] + ids(8, 2)
    with pytest.raises(InvalidArgumentError) as err:
        scheduler.add_request(turn("x", ids(9, 2), SessionParams("s", "t1", offset=999)))
    assert err.value.field == "session_params.offset"


def test_replace_with_a_rid_drops_the_parents_other_continuations(scheduler: Scheduler) -> None:
    t1 = run(scheduler, turn("t1", ids(10, 6), SessionParams("s")))
    run(scheduler, turn("t2", ids(11, 2), SessionParams("s", "t1")))
    running = turn("t3", ids(12, 2), SessionParams("s", "t1"), max_new=50)
    scheduler.add_request(running)
    scheduler.step()
    t4 = turn("t4", ids(13, 2), SessionParams("s", "t1", replace=True))
    run(scheduler, t4)
    assert running.finish is not None and running.finish.kind == "abort"  # was running
    assert t4.input_ids == full(t1) + ids(13, 2)
    for gone in ("t2", "t3"):
        with pytest.raises(InvalidArgumentError, match="has no request"):
            scheduler.add_request(turn("y", ids(14, 2), SessionParams("s", gone)))
    run(scheduler, turn("t5", ids(15, 2), SessionParams("s", "t4")))  # t4 is a parent


def test_replace_without_a_rid_starts_the_tree_afresh(scheduler: Scheduler) -> None:
    run(scheduler, turn("t1", ids(16, 6), SessionParams("s")))
    locked = scheduler.kv.tree.num_locked
    fresh = run(scheduler, turn("t2", ids(17, 4), SessionParams("s", replace=True)))
    assert fresh.input_ids == ids(17, 4)
    assert scheduler.kv.tree.num_locked == len(full(fresh)) != locked  # t1's pin is gone
    with pytest.raises(InvalidArgumentError, match="has no request"):
        scheduler.add_request(turn("t3", ids(18, 2), SessionParams("s", "t1")))


def test_unfinished_aborted_and_unknown_parents_are_refused(scheduler: Scheduler) -> None:
    waiting = turn("w", ids(19, 4), SessionParams("s"), max_new=50)
    scheduler.add_request(waiting)
    with pytest.raises(InvalidArgumentError, match="has not finished") as err:
        scheduler.add_request(turn("c1", ids(20, 2), SessionParams("s", "w")))
    assert err.value.field == "session_params.rid"
    scheduler.abort("w", "client went away")
    with pytest.raises(InvalidArgumentError, match="was aborted"):
        scheduler.add_request(turn("c2", ids(20, 2), SessionParams("s", "w")))
    with pytest.raises(InvalidArgumentError, match="has no request"):
        scheduler.add_request(turn("c3", ids(20, 2), SessionParams("s", "nope")))
    with pytest.raises(InvalidArgumentError) as err:
        scheduler.add_request(turn("c4", ids(20, 2), SessionParams("nope")))
    assert err.value.field == "session_params.id"
    run_to_completion(scheduler)
    assert not scheduler.reqs  # no refused request was queued


def test_capacity_bounds_what_a_request_may_hold(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir)
    scheduler.open_session("small", capacity=12, owner=OWNER)
    run(scheduler, turn("t1", ids(21, 6), SessionParams("small")))  # 6 + 5 = 11 tokens
    with pytest.raises(InvalidArgumentError, match="at most 12"):
        scheduler.add_request(turn("t2", ids(22, 2), SessionParams("small", "t1")))
    run(scheduler, turn("t3", ids(22, 1), SessionParams("small", "t1")))  # 12 fits


def test_open_refuses_duplicates_and_bad_capacity(scheduler: Scheduler) -> None:
    with pytest.raises(AlreadyExistsError):
        scheduler.open_session("s", capacity=10, owner=OWNER)
    with pytest.raises(InvalidArgumentError) as err:
        scheduler.open_session("t", capacity=0, owner=OWNER)
    assert err.value.field == "capacity_of_str_len"
    with pytest.raises(InvalidArgumentError):
        scheduler.close_session("never-opened")


def test_the_owners_end_closes_its_sessions_and_aborts_their_requests(
    scheduler: Scheduler,
) -> None:
    scheduler.open_session("theirs", capacity=1000, owner="frontend-b")
    run(scheduler, turn("t1", ids(23, 6), SessionParams("s")))
    run(scheduler, turn("b1", ids(24, 6), SessionParams("theirs")))
    running = turn("t2", ids(25, 2), SessionParams("s", "t1"), max_new=50)
    scheduler.add_request(running)
    scheduler.step()
    assert scheduler.close_sessions_of(OWNER, "frontend went away") == 1
    assert running.finish is not None and running.finish.message == "frontend went away"
    scheduler.close_session("theirs")
    run_to_completion(scheduler)
    assert_kv_returns_to_pool(scheduler)


def test_the_engine_thread_answers_session_commands(default_model_dir: Path) -> None:
    """Session commands and session requests go through the inbox like add and abort; the
    engine thread's verdict comes back on a future, and the owner's end closes them."""
    finished: list[str] = []
    engine = EngineThread(
        make_scheduler(default_model_dir),
        lambda rows: finished.extend(r.rid for r in rows if r.finish is not None),
    )
    engine.start()
    try:
        engine.ask(OpenSessionCommand("s", 100, OWNER)).result(timeout=10)
        with pytest.raises(AlreadyExistsError):
            engine.ask(OpenSessionCommand("s", 100, OWNER)).result(timeout=10)
        orphan = turn("orphan", ids(26, 3), SessionParams("s", rid="nope"))
        refusal = engine.add_request(orphan)
        assert refusal is not None
        with pytest.raises(InvalidArgumentError):
            refusal.result(timeout=10)
        accepted = engine.add_request(turn("t1", ids(26, 3), SessionParams("s")))
        assert accepted is not None and accepted.result(timeout=10) is None
        wait_until(lambda: "t1" in finished, timeout=30)
        assert len(engine.live) == 0 and "orphan" not in finished  # refused: no row at all
        assert engine.stats.num_sessions == 1
        engine.tell(AbortOwnedCommand(OWNER, "frontend went away"))
        wait_until(lambda: engine.stats.num_sessions == 0)
        with pytest.raises(InvalidArgumentError):
            engine.ask(CloseSessionCommand("s")).result(timeout=10)
    finally:
        engine.stop()
