"""Which steps produce a row: a streamed request's first token at once and then every
``stream_interval`` tokens; a unary request only its final row. Same tokens either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import Scheduler
from tests.scheduler.factories import assert_kv_returns_to_pool, make_req, make_scheduler

PROMPT = [0, *range(1000, 1011)]


def rows_of(
    scheduler: Scheduler, req: Req, abort_after_steps: int | None = None
) -> list[OutputRow]:
    """Every row ``req`` produced, stepping until the scheduler is idle."""
    scheduler.add_request(req)
    rows: list[OutputRow] = []
    steps = 0
    while scheduler.has_work:
        rows += [row for row in scheduler.step() if row.rid == req.rid]
        steps += 1
        if steps == abort_after_steps:
            assert scheduler.abort(req.rid)
    return rows


def sampled(rid: str, stream: bool, max_new_tokens: int = 11) -> Req:
    req = make_req(
        rid, PROMPT, temperature=1.0, seed=7, max_new_tokens=max_new_tokens, ignore_eos=True
    )
    req.stream = stream
    req.return_logprob = True
    return req


@pytest.mark.parametrize("interval", [1, 4])
def test_streamed_rows_come_first_token_then_every_interval(
    default_model_dir: Path, interval: int
) -> None:
    reference = rows_of(make_scheduler(default_model_dir), sampled("ref", stream=True))
    scheduler = make_scheduler(default_model_dir, stream_interval=interval)
    rows = rows_of(scheduler, sampled("s", stream=True))
    sizes = [len(r.new_token_ids) for r in rows]
    # 11 tokens: 1 at once, then full intervals, then what is left at the finish.
    expected = [1] + [interval] * (10 // interval) + ([10 % interval] if 10 % interval else [])
    assert sizes == expected
    assert [t for r in rows for t in r.new_token_ids] == [
        t for r in reference for t in r.new_token_ids
    ]
    assert [lp[0] for r in rows for lp in r.logprobs] == [t for r in rows for t in r.new_token_ids]
    assert rows[0].init is not None and all(r.init is None for r in rows[1:])
    assert rows[-1].finish is not None and all(r.finish is None for r in rows[:-1])
    assert_kv_returns_to_pool(scheduler)


def test_unary_request_sends_one_final_row_with_every_token(default_model_dir: Path) -> None:
    streamed = rows_of(make_scheduler(default_model_dir), sampled("ref", stream=True))
    scheduler = make_scheduler(default_model_dir, stream_interval=4)
    rows = rows_of(scheduler, sampled("u", stream=False))
    assert len(rows) == 1
    (row,) = rows
    assert row.finish is not None and row.finish.kind == "length"
    assert row.init is not None  # the detokenizer still gets its decode flags
    assert list(row.new_token_ids) == [t for r in streamed for t in r.new_token_ids]
    assert [lp[0] for lp in row.logprobs] == list(row.new_token_ids)
    assert row.num_output_tokens == 11


def test_an_aborted_unary_request_still_reports_the_tokens_it_made(
    default_model_dir: Path,
) -> None:
    scheduler = make_scheduler(default_model_dir)
    rows = rows_of(scheduler, sampled("u", stream=False, max_new_tokens=50), abort_after_steps=5)
    assert len(rows) == 1
    (row,) = rows
    assert row.finish is not None and row.finish.kind == "abort"
    assert 0 < len(row.new_token_ids) == row.num_output_tokens < 50
    assert_kv_returns_to_pool(scheduler)
