"""Overlap scheduling (``overlap_schedule``): the next decode step is scheduled and
submitted to the forward worker before the in-flight one is committed. It runs the same
``execute`` on the same plans as the synchronous scheduler, and everything a client sees
is what that gives: the same tokens, finish reasons and rows, with the KV back in the pool
at the end. The tiny model runs in float32, where a row's logits do
not depend on its batch, so greedy and seeded outputs compare exactly."""

from __future__ import annotations

import random
from concurrent.futures import Future
from pathlib import Path

import pytest

from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.scheduler_output import ExecuteOutput, SchedulerOutput
from tests.scheduler.factories import (
    assert_kv_conserved,
    assert_kv_returns_to_pool,
    make_req,
    make_scheduler,
)

_RNG = random.Random(12)
PROMPTS = [[_RNG.randrange(1000, 60000) for _ in range(_RNG.randrange(4, 30))] for _ in range(10)]


def count_overlapped(scheduler: Scheduler) -> list[int]:
    """A one-element counter of the steps scheduled on top of one in flight (a spy that
    forwards every call to the forward worker, so it still runs them)."""
    worker = scheduler._worker
    assert worker is not None
    overlapped = [0]
    submit = worker.submit

    def counted(
        out: SchedulerOutput, previous: Future[ExecuteOutput] | None
    ) -> Future[ExecuteOutput]:
        overlapped[0] += previous is not None
        return submit(out, previous)

    worker.submit = counted  # type: ignore[method-assign]
    return overlapped


def record_executes(scheduler: Scheduler) -> list[tuple]:
    """Every step the scheduler's executor runs, in order: its requests, their inputs (a
    placeholder resolved), prefix and slot counts, the rows that sample and the tokens they
    sampled. A spy that forwards every call, on whichever thread runs it."""
    calls: list[tuple] = []
    execute = scheduler.executor.execute

    def recorded(out: SchedulerOutput, inflight_tokens: list[int] | None = None) -> ExecuteOutput:
        result = execute(out, inflight_tokens)
        plan = out.forward_plan(inflight_tokens)
        slots = [len(s) for s in out.kv_slots]
        rids = [r.rid for r in out.reqs]
        step = (rids, plan.new_token_ids, out.prefix_lens, slots, out.sample_rows)
        calls.append((*step, result.sampled.token_ids))
        return result

    scheduler.executor.execute = recorded  # type: ignore[method-assign]
    return calls


def run(
    scheduler: Scheduler,
    arrivals: dict[int, list[Req]],
    abort_at: dict[int, str] | None = None,
) -> dict[str, list[OutputRow]]:
    """Step until idle; add arrivals and abort rids before the given steps; rows per rid."""
    rows: dict[str, list[OutputRow]] = {}
    step = 0
    while scheduler.has_work or step <= max(arrivals):
        for req in arrivals.get(step, []):
            scheduler.add_request(req)
        if abort_at and step in abort_at:
            scheduler.abort(abort_at[step], "client went away")
        for row in scheduler.step():
            rows.setdefault(row.rid, []).append(row)
        assert_kv_conserved(scheduler)
        step += 1
        assert step < 2_000
    return rows


def tokens(rows: dict[str, list[OutputRow]]) -> dict[str, list[int]]:
    return {rid: [t for row in rs for t in row.new_token_ids] for rid, rs in rows.items()}


def finishes(rows: dict[str, list[OutputRow]]) -> dict[str, str | None]:
    return {rid: rs[-1].finish.kind if rs[-1].finish else None for rid, rs in rows.items()}


def workload(**params: object) -> dict[int, list[Req]]:
    """Eight requests at once with different lengths, two more while they decode."""
    first = [
        make_req(f"r{i}", PROMPTS[i], max_new_tokens=6 + 3 * i, ignore_eos=True, **params)
        for i in range(8)
    ]
    later = [
        make_req(f"late{i}", PROMPTS[8 + i], max_new_tokens=9, ignore_eos=True, **params)
        for i in range(2)
    ]
    return {0: first, 7: later}


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11}])
def test_same_tokens_and_rows_as_synchronous(default_model_dir: Path, params: dict) -> None:
    reference = run(make_scheduler(default_model_dir), workload(**params))
    scheduler = make_scheduler(default_model_dir, overlap_schedule=True)
    overlapped = count_overlapped(scheduler)
    rows = run(scheduler, workload(**params))
    assert tokens(rows) == tokens(reference)
    assert finishes(rows) == finishes(reference) == dict.fromkeys(rows, "length")
    # Rows are cut the same way (first token alone, then one per step): only their timing
    # shifts by one step.
    assert {r: len(rs) for r, rs in rows.items()} == {r: len(rs) for r, rs in reference.items()}
    # Every decode step overlapped the one before but the first after each of the two
    # prefills, and the step that admitted the late pair.
    assert overlapped[0] >= max(len(t) for t in tokens(rows).values()) - 4
    assert_kv_returns_to_pool(scheduler)


def test_overlap_pipelines_the_same_executes(default_model_dir: Path) -> None:
    """A decode workload (every request admitted at once, each ending by length) runs the
    very same sequence of steps through ``execute`` with and without overlap; with it, the
    decodes fed the in-flight step's tokens through placeholders."""
    arrivals = {0: workload(temperature=0.0)[0]}
    sync = make_scheduler(default_model_dir)
    sync_calls = record_executes(sync)
    reference = run(sync, arrivals)
    scheduler = make_scheduler(default_model_dir, overlap_schedule=True)
    calls = record_executes(scheduler)
    overlapped = count_overlapped(scheduler)
    arrivals = {0: workload(temperature=0.0)[0]}
    assert tokens(run(scheduler, arrivals)) == tokens(reference)
    assert calls == sync_calls
    assert overlapped[0] == len(calls) - 2  # all but the prefill and the first decode


def test_a_stop_token_mid_chain_ends_the_request_and_drops_its_extra_row(
    default_model_dir: Path,
) -> None:
    """The step after a stop token was planned before the stop was seen: its row for the
    finished request is computed and dropped, and the others go on unchanged."""
    greedy = tokens(run(make_scheduler(default_model_dir), workload(temperature=0.0)))
    stop = greedy["r5"][4]  # r5's fifth token: it stops there, mid-decode
    reference = run(
        make_scheduler(default_model_dir), workload(temperature=0.0, stop_token_ids=[stop])
    )
    scheduler = make_scheduler(default_model_dir, overlap_schedule=True)
    rows = run(scheduler, workload(temperature=0.0, stop_token_ids=[stop]))
    assert tokens(rows) == tokens(reference)
    assert tokens(rows)["r5"][-1] == stop and len(tokens(rows)["r5"]) <= 5
    assert finishes(rows) == finishes(reference)
    assert finishes(rows)["r5"] == "stop"
    assert_kv_returns_to_pool(scheduler)


def test_an_abort_while_a_step_is_in_flight(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir, overlap_schedule=True)
    rows = run(scheduler, workload(temperature=0.0), abort_at={4: "r7"})
    aborted = rows["r7"]
    assert aborted[-1].finish is not None and aborted[-1].finish.kind == "abort"
    assert all(row.finish is None for row in aborted[:-1])
    # Nothing of r7 after its abort row; every other request is what greedy gives alone.
    reference = tokens(run(make_scheduler(default_model_dir), workload(temperature=0.0)))
    assert tokens(rows)["r7"] == reference["r7"][: len(tokens(rows)["r7"])]
    assert len(tokens(rows)["r7"]) < len(reference["r7"])
    others = {rid: t for rid, t in tokens(rows).items() if rid != "r7"}
    assert others == {rid: t for rid, t in reference.items() if rid != "r7"}
    assert_kv_returns_to_pool(scheduler)


def with_penalty() -> dict[int, list[Req]]:
    plain = make_req("plain", PROMPTS[0], max_new_tokens=8, temperature=0.0, ignore_eos=True)
    penalised = make_req(
        "penalised", PROMPTS[1], max_new_tokens=8, temperature=0.0, repetition_penalty=1.3
    )
    return {0: [plain, penalised]}


def test_a_request_with_penalties_runs_synchronously(default_model_dir: Path) -> None:
    """Penalties read every committed token: with such a request running, no step chains."""
    reference = run(make_scheduler(default_model_dir), with_penalty())
    scheduler = make_scheduler(default_model_dir, overlap_schedule=True)
    overlapped = count_overlapped(scheduler)
    rows = run(scheduler, with_penalty())
    assert overlapped[0] == 0
    assert tokens(rows) == tokens(reference)
    assert_kv_returns_to_pool(scheduler)
