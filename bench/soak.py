"""Soak (issue 13): many concurrent client loops against a fresh local stack for a bounded
time, then proof that nothing failed, nothing stayed live and no service grew.

``python -m bench.soak`` starts its own four processes on free loopback ports, runs
``--concurrency`` loops for ``--duration-s`` seconds (each loop sends one request after
another: chat or completions, stream or unary, some with ``stop`` strings, some with
n = 2 or 3, mostly T = 1.0, some greedy; ``--cancel-fraction`` of them cancelled by the
client mid-flight), stops them, and checks three things:

* zero unexpected failures: any error other than the client's own cancel, a response that
  fails its minimal check, or a request still running a grace period after the window;
* zero leaked state: within 10 s every process holds no request and no KV;
* each service's RSS grows < 5 % from just after the warm-up to the end of the window:
  the floor (lowest of 5 s of 1 s samples) at each end, both under the same full load.
  A step's transient buffers only add to a sample (the engine's swing 70-90 MiB above a
  flat floor, and a median of five caught them often enough to read +5 % on a flat
  timeline); a leak raises the floor. The RSS after the drain is reported too.

It prints a report, writes JSON (``--out``) and exits non-zero if a check fails. It stops
exactly the processes it started, on Ctrl-C or SIGTERM too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import httpx
import openai

from bench.machine import describe, machine_info
from bench.procs import SERVICES, read_rss_mib, stack_pids
from bench.soak_client import MAX_N, UNEXPECTED, Outcome, Tally, client_loop
from services.common.default_model import ensure_default_model
from services.launch import LocalStack, StackPorts
from services.scheduler.model_executor.models.dtype import AUTO, DTYPES

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "tokenline-tiny"
RESULTS = REPO_ROOT / "bench" / "results"
# RSS is tracked for each service and for the scheduler's engine process (its child).
RSS_TRACKED = (*SERVICES, "engine")
MAX_RSS_GROWTH = 0.05
DRAIN_LIMIT_S = 10.0
GRACE_S = 60.0  # how long requests in flight at the window's end may take to finish
REQUEST_TIMEOUT_S = 120.0
RSS_EVERY_S = 1.0
# RSS is the floor over this long: a sample may land on a step's transient buffers.
RSS_WINDOW_S = 5.0


def rss_of(stack: LocalStack) -> dict[str, float]:
    return {name: sum(map(read_rss_mib, pids)) for name, pids in stack_pids(stack).items()}


def wait_for_idle(stack: LocalStack, limit_s: float) -> tuple[dict[str, int], float]:
    """The live state once all zero, or as it is after ``limit_s``; and the wait."""
    start = time.monotonic()
    while any((held := stack.live_state()).values()) and time.monotonic() - start < limit_s:
        time.sleep(0.1)
    return held, time.monotonic() - start


async def sample_rss(stack: LocalStack, start: float, timeline: list[dict[str, float]]) -> None:
    """Every service's RSS every ``RSS_EVERY_S`` until cancelled."""
    while True:
        timeline.append({"t_s": round(time.monotonic() - start, 1), **rss_of(stack)})
        await asyncio.sleep(RSS_EVERY_S)


@dataclass(slots=True)
class LoadResult:
    tally: Tally
    window_s: float
    rss_timeline: list[dict[str, float]]  # every RSS_EVERY_S from the start of the load


async def run_load(stack: LocalStack, args: argparse.Namespace) -> LoadResult:
    """The loops for ``duration_s`` with RSS sampled throughout, then up to ``GRACE_S``
    for requests in flight; those left are ``unfinished``."""
    tally, model = Tally(), Path(args.model_dir).name
    limits = httpx.Limits(max_connections=4 * args.concurrency, max_keepalive_connections=None)
    http = openai.DefaultAsyncHttpxClient(limits=limits, timeout=REQUEST_TIMEOUT_S)
    client = openai.AsyncOpenAI(
        base_url=stack.base_url,
        api_key="unused",
        max_retries=0,
        timeout=REQUEST_TIMEOUT_S,
        http_client=http,
    )
    start = time.monotonic()
    deadline = start + args.duration_s
    timeline: list[dict[str, float]] = []
    sampler = asyncio.create_task(sample_rss(stack, start, timeline))
    loops = [
        asyncio.create_task(
            client_loop(
                client, model, random.Random(f"{args.seed}-{i}"), deadline,
                args.cancel_fraction, tally,
            )
        )
        for i in range(args.concurrency)
    ]  # fmt: skip
    _, pending = await asyncio.wait(loops, timeout=args.duration_s + GRACE_S)
    for loop in pending:
        loop.cancel()
    sampler.cancel()
    await asyncio.gather(*pending, sampler, return_exceptions=True)
    tally.outcomes += [Outcome("unfinished", "?", GRACE_S, detail="still running")] * len(pending)
    await client.close()
    return LoadResult(tally, args.duration_s, timeline)


def percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0] * 1e3
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1] * 1e3


def floor_rss(timeline: list[dict[str, float]], start_s: float, end_s: float) -> dict[str, float]:
    """Each service's lowest RSS over the samples taken in [start_s, end_s)."""
    rows = [r for r in timeline if start_s <= r["t_s"] < end_s] or timeline[-1:]
    return {name: min(r[name] for r in rows) for name in RSS_TRACKED}


def rss_growth(load: LoadResult, warmup_s: float, drained: dict[str, float]) -> dict[str, Any]:
    """Per service: the floor just after the warm-up against the floor at the end of the
    window (both under the same full load), and the RSS after the drain."""
    span = min(RSS_WINDOW_S, (load.window_s - warmup_s) / 2)
    warm = floor_rss(load.rss_timeline, warmup_s, warmup_s + span)
    end = floor_rss(load.rss_timeline, load.window_s - span, load.window_s)
    return {
        name: {
            "warm_mib": warm[name],
            "end_mib": end[name],
            "drained_mib": drained[name],
            # No engine child (--engine thread) is no growth; anything from nothing is.
            "growth": end[name] / warm[name] - 1 if warm[name] else float(end[name] > 0),
        }
        for name in RSS_TRACKED
    }


def build_report(
    load: LoadResult,
    warmup_s: float,
    held: dict[str, int],
    drain_s: float,
    rss_drained: dict[str, float],
    alive: dict[str, bool],
) -> dict[str, Any]:
    """The figures and the verdict, as the JSON holds them."""
    tally, counts = load.tally, load.tally.counts()
    done = [o for o in tally.outcomes if o.status == "completed"]
    tokens = sum(o.completion_tokens for o in done)
    e2e = [o.latency_s for o in done]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    rss = rss_growth(load, warmup_s, rss_drained)
    unexpected = sum(counts[s] for s in UNEXPECTED)
    criteria = {
        "no_unexpected_failures": unexpected == 0,
        "no_leaked_state": not any(held.values()),
        "rss_growth_under_5pct": all(r["growth"] < MAX_RSS_GROWTH for r in rss.values()),
        "services_alive": all(alive.values()),
    }
    return {
        "counts": counts,
        "cancels_asked": tally.num_cancels_asked,
        "unexpected_failures": unexpected,
        "errors": tally.errors(),
        "kinds": dict(sorted(tally.kinds.items())),
        "completion_tokens": tokens,
        "tok_per_s": tokens / load.window_s,
        "latency_ms": {
            "e2e_p50": percentile_ms(e2e, 50),
            "e2e_p99": percentile_ms(e2e, 99),
            "ttft_p50": percentile_ms(ttft, 50),
            "ttft_p99": percentile_ms(ttft, 99),
        },
        "rss": rss,
        "rss_timeline": load.rss_timeline,
        "live_state_after": held,
        "drain_s": drain_s,
        "criteria": criteria,
        "passed": all(criteria.values()),
    }


def format_report(report: dict[str, Any]) -> str:
    c, lat = report["counts"], report["latency_ms"]
    lines = [
        f"scheduler dtype: {report['scheduler_dtype']}",
        f"requests: {c['started']} started, {c['completed']} completed, "
        f"{c['cancelled']} cancelled by the client ({report['cancels_asked']} cancels drawn, "
        f"{report['frontend_aborts_sent']} aborts sent by the frontend)",
        f"unexpected failures: {report['unexpected_failures']} (overloaded {c['overloaded']}, "
        f"failed {c['failed']}, invalid {c['invalid']}, unfinished {c['unfinished']})",
        *(f"  error: {e}" for e in report["errors"]),
        f"mix: {report['kinds']}",
        f"throughput: {report['tok_per_s']:.0f} completion tok/s "
        f"({report['completion_tokens']} tokens in completed requests)",
        "latency: e2e p50 {} ms, p99 {} ms; TTFT (streams) p50 {} ms, p99 {} ms".format(
            *(f"{v:.0f}" if v is not None else "-" for v in lat.values())
        ),
    ]
    for name, r in report["rss"].items():
        lines.append(
            f"RSS {name:<11} {r['warm_mib']:7.1f} -> {r['end_mib']:7.1f} MiB "
            f"({r['growth']:+.2%}); after drain {r['drained_mib']:.1f} MiB"
        )
    lines.append(f"live state after {report['drain_s']:.1f} s: {report['live_state_after']}")
    failed = [name for name, ok in report["criteria"].items() if not ok]
    lines.append("PASSED" if report["passed"] else f"FAILED: {', '.join(failed)}")
    return "\n".join(lines)


def create_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description="bounded soak of a fresh local stack: failures, leaked state, RSS growth",
    )
    p.add_argument("--concurrency", type=int, default=256, help="client loops")
    p.add_argument("--duration-s", type=float, default=60.0, help="load window")
    p.add_argument("--warmup-s", type=float, default=10.0, help="RSS baseline taken after this")
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--dtype", choices=[AUTO, *DTYPES], default=AUTO, help="the scheduler's")
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = create_parser()
    args = p.parse_args(argv)
    if args.concurrency < 1 or not 0 <= args.cancel_fraction <= 1:
        p.error("--concurrency must be >= 1 and --cancel-fraction within [0, 1]")
    if not 0 < args.warmup_s < args.duration_s:
        p.error("--warmup-s must be > 0 and shorter than --duration-s")
    return args


def start_stack(args: argparse.Namespace) -> LocalStack:
    """A fresh stack whose scheduler admits every request the loops can hold at once."""
    if Path(args.model_dir).resolve() == DEFAULT_MODEL_DIR:
        ensure_default_model(DEFAULT_MODEL_DIR)
    # Each loop holds up to MAX_N rids; a cancelled one stays live until its abort lands,
    # so 4x that bound keeps 429s out of the picture (they would count as failures).
    live_bound = max(4096, 4 * MAX_N * args.concurrency)
    stack = LocalStack(
        args.model_dir,
        StackPorts.free(),
        scheduler_args=["--max-waiting-requests", str(live_bound), "--dtype", args.dtype],
        log_dir=args.out.parent / f"{args.out.stem}-logs",
    )
    stack.start(timeout=300)
    return stack


def soak(stack: LocalStack, args: argparse.Namespace) -> dict[str, Any]:
    dtype = stack.scheduler_info().dtype
    load = asyncio.run(run_load(stack, args))
    alive = {name: stack.procs[name].poll() is None for name in SERVICES}
    held, drain_s = wait_for_idle(stack, DRAIN_LIMIT_S) if all(alive.values()) else ({}, 0.0)
    report = build_report(load, args.warmup_s, held, drain_s, rss_of(stack), alive)
    # AbortReqs the frontend sent: the client's cancels that reached the scheduler.
    aborts = stack.frontend_info().num_aborts_sent if all(alive.values()) else None
    return {"scheduler_dtype": dtype, "frontend_aborts_sent": aborts, **report}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()
    print(f"machine: {describe(machine)}", flush=True)
    print(
        f"soak: {args.concurrency} loops for {args.duration_s:.0f} s, "
        f"{args.cancel_fraction:.0%} cancels, model {args.model_dir} ({args.dtype})",
        flush=True,
    )
    stack = start_stack(args)
    try:
        report = soak(stack, args)
    finally:
        stack.stop()
    report = {"machine": machine, "args": {**vars(args), "out": str(args.out)}, **report}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    print(f"wrote {args.out}")
    return 0 if report["passed"] else 1


def _interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: the stack is stopped


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
