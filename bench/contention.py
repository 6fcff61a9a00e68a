"""What a co-runner on the same cores costs the engine: why the split cannot reach the
engine alone on a machine the engine already fills.

``python -m bench.contention`` builds the engine as the scheduler process does, then
alternates rounds of C requests stepped to the end: the engine alone, and the engine beside
a co-runner process that burns the CPU in short bursts, as the services do when a step's
rows reach them (spin for some microseconds, then sleep out the rest of a period; two
profiles). For each profile it reports the engine's tokens/s both ways and two shares of
the machine's cores: what the co-runner used, and what the engine lost. Their ratio
(``amplification``) is what multiplies the services' CPU in ``bench.split``: above 1 when
a torch thread that loses its core mid-kernel leaves its partner waiting at the kernel's
end (oneDNN's matmuls, two thirds of a decode step here, split their work in fixed
blocks per thread).

Writes ``bench/results/contention.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.machine import describe, machine_info
from bench.procs import cpu_seconds
from bench.serve.report import write_json
from bench.split import prompts, run_engine
from services.scheduler.__main__ import parse_args as scheduler_args
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.transport.engine_build import build_scheduler

RESULTS = Path(__file__).resolve().parent / "results"
PROFILES = ((60, 400), (600, 4000))  # (busy, period) in µs: both about 0.15 of a core


@dataclass(slots=True)
class ProfileRow:
    busy_us: int
    period_us: int
    alone_tok_s: float
    beside_tok_s: float
    co_runner_share: float  # of all cores: the co-runner's CPU time over cores x wall time
    engine_lost_share: float  # 1 - beside / alone
    amplification: float  # engine_lost_share / co_runner_share
    rounds: list[tuple[float, float]]  # (alone, beside) tokens/s of each round


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__)
    p.add_argument("--model", default="models/tokenline-tiny")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=0, help="the engine's (0: its default)")
    p.add_argument("--out", type=Path, default=RESULTS / "contention.json")
    return p.parse_args(argv)


# The co-runner, a bare interpreter (no imports to compete with the engine): spin busy µs,
# sleep out the period, until killed. It says "ready" once it runs.
BURNER = """
import sys, time
busy, period = int(sys.argv[1]) * 1e-6, int(sys.argv[2]) * 1e-6
print("ready", flush=True)
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(period - busy)
"""


def start_co_runner(busy_us: int, period_us: int) -> subprocess.Popen:
    """The co-runner process, returned once it runs (the caller kills it)."""
    co_runner = subprocess.Popen(
        [sys.executable, "-c", BURNER, str(busy_us), str(period_us)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert co_runner.stdout is not None
    if co_runner.stdout.readline() != "ready\n":
        co_runner.kill()
        raise RuntimeError("the co-runner did not start")
    return co_runner


def beside_co_runner(
    scheduler: Scheduler, ids: list[list[int]], args: argparse.Namespace, busy: int, period: int
) -> tuple[float, float]:
    """Tokens/s of one round beside a fresh co-runner, and the share of the cores it took."""
    co_runner = start_co_runner(busy, period)
    try:
        cpu_before, start = cpu_seconds(co_runner.pid), time.perf_counter()
        tok_s = run_engine(scheduler, ids, args.output_len, args.temperature).tok_s
        share = (cpu_seconds(co_runner.pid) - cpu_before) / (
            (time.perf_counter() - start) * (os.cpu_count() or 1)
        )
    finally:
        co_runner.kill()
        co_runner.wait()
    return tok_s, share


def measure(scheduler: Scheduler, args: argparse.Namespace) -> list[ProfileRow]:
    rows = []
    for busy, period in PROFILES:
        rounds, shares = [], []
        for r in range(args.rounds):
            ids = prompts(args.concurrency, args.input_len, seed=r)
            if r % 2:  # alternate which goes first: the machine's speed drifts
                beside, share = beside_co_runner(scheduler, ids, args, busy, period)
                alone = run_engine(scheduler, ids, args.output_len, args.temperature).tok_s
            else:
                alone = run_engine(scheduler, ids, args.output_len, args.temperature).tok_s
                beside, share = beside_co_runner(scheduler, ids, args, busy, period)
            rounds.append((alone, beside))
            shares.append(share)
        row = profile_row(busy, period, rounds, shares)
        print(
            f"co-runner {busy} us every {period} us: engine {row.alone_tok_s:7.1f} -> "
            f"{row.beside_tok_s:7.1f} tok/s; co-runner used {row.co_runner_share:.1%} of the "
            f"cores, the engine lost {row.engine_lost_share:.1%} (x{row.amplification:.1f})",
            flush=True,
        )
        rows.append(row)
    return rows


def profile_row(
    busy: int, period: int, rounds: list[tuple[float, float]], shares: list[float]
) -> ProfileRow:
    """Medians over the rounds; the loss is the median of each round's own ratio."""
    lost = 1 - statistics.median(beside / alone for alone, beside in rounds)
    share = statistics.median(shares)
    return ProfileRow(
        busy,
        period,
        statistics.median(alone for alone, _ in rounds),
        statistics.median(beside for _, beside in rounds),
        share,
        lost,
        lost / share,
        rounds,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_info()
    print(f"machine: {describe(machine)}", flush=True)
    scheduler, dtype = build_scheduler(
        scheduler_args(["--model", args.model, "--num-threads", str(args.num_threads)])
    )
    # Warm-up at the measured batch shape, unmeasured.
    run_engine(scheduler, prompts(args.concurrency, args.input_len, seed=99), 8, args.temperature)
    rows = measure(scheduler, args)
    report = {
        "machine": machine,
        "dtype": dtype,
        "args": vars(args) | {"out": str(args.out)},
        "profiles": [asdict(row) for row in rows],
    }
    write_json(report, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
