"""bench.contention's arithmetic, and its co-runner as a real process."""

from __future__ import annotations

import time

import pytest

from bench.contention import profile_row, start_co_runner
from bench.procs import cpu_seconds


def test_a_profile_row_takes_medians_and_the_loss_per_round() -> None:
    rounds = [(1000.0, 800.0), (2000.0, 1800.0), (1500.0, 1200.0)]
    row = profile_row(60, 400, rounds, shares=[0.05, 0.1, 0.08])
    assert (row.alone_tok_s, row.beside_tok_s) == (1500.0, 1200.0)
    assert row.engine_lost_share == pytest.approx(0.2)  # ratios 0.8, 0.9, 0.8: median 0.8
    assert row.co_runner_share == pytest.approx(0.08)
    assert row.amplification == pytest.approx(2.5)


def test_the_co_runner_burns_cpu_until_killed() -> None:
    co_runner = start_co_runner(busy_us=2000, period_us=4000)
    try:
        before = cpu_seconds(co_runner.pid)
        time.sleep(0.5)
        assert cpu_seconds(co_runner.pid) > before  # it spins between its sleeps
    finally:
        co_runner.kill()
        co_runner.wait()
    assert co_runner.returncode is not None and cpu_seconds(co_runner.pid) == 0.0
