"""bench.split's accounting and bench.procs' /proc readers, on real processes; and the
gRPC floor benchmark on a real grpc.aio server process."""

from __future__ import annotations

import os
import time

import pytest

from bench.grpc_floor import measure_floor
from bench.procs import cpu_seconds, read_rss_mib
from bench.split import Round, _cell, cpu_line, floor_line, phase_line


def test_cpu_seconds_counts_this_process_working_and_a_gone_pid_reads_zero() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.2
    assert read_rss_mib(os.getpid()) > 10
    assert cpu_seconds(2**22 + 12_345) == 0.0 and read_rss_mib(2**22 + 12_345) == 0.0


def test_a_cell_takes_medians_of_rounds_and_names_every_process() -> None:
    engine = [Round(1000.0, {"engine": us}, 0.6, 2.4) for us in (900.0, 1000.0, 1100.0)]
    stack = [
        Round(tok_s, {"engine": 1200.0, "gateway": gw, "frontend": 80.0}, first, 3.2)
        for tok_s, gw, first in ((700.0, 90.0, 0.8), (800.0, 100.0, 0.7), (600.0, 95.0, 1.2))
    ]
    cell = _cell(1.0, 64, engine, stack)
    assert cell["ratio"] == pytest.approx(0.7)
    assert cell["round_ratios"] == pytest.approx([0.7, 0.8, 0.6])
    assert cell["engine_alone_cpu_us_per_token"] == pytest.approx(1000.0)
    assert cell["stack_cpu_us_per_token"] == pytest.approx(
        {"engine": 1200.0, "gateway": 95.0, "frontend": 80.0}
    )
    line = cpu_line(cell)
    assert "engine alone 1,000" in line and "gateway 95" in line and "frontend 80" in line
    # Medians of each phase: first tokens 0.6 s against 0.8; after them 1.8 s against 2.4.
    assert cell["phases_ms"]["engine"] == pytest.approx({"first_tokens": 600.0, "after": 1800.0})
    assert cell["phases_ms"]["stack"] == pytest.approx({"first_tokens": 800.0, "after": 2400.0})
    assert phase_line(cell) == (
        "round (ms): until every first token engine 600, stack 800; "
        "after it engine 1,800, stack 2,400 (the stack at 0.75x the engine's pace)"
    )
    floor = {"client_read_us_per_message": 38.0, "server_write_us_per_message": 40.0}
    assert "(2.5x the read)" in floor_line(floor, [cell])
    assert "(2.0x the write)" in floor_line(floor, [cell])
    # A short run's floor can read 0 CPU (below one /proc tick): said, not divided by.
    short = {"client_read_us_per_message": 38.0, "server_write_us_per_message": 0.0}
    assert "(the write under one clock tick)" in floor_line(short, [cell])


def test_the_grpc_floor_reads_every_message_and_costs_cpu_on_both_sides() -> None:
    # 512 messages: enough CPU on each side to span several 10 ms /proc ticks.
    floor = measure_floor(streams=16, messages=32, step_s=0.002)
    assert floor["client_read_us_per_message"] > 0
    assert floor["server_write_us_per_message"] > 0
