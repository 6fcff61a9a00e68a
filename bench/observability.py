"""What observability costs: engine steps with Prometheus recording vs without, and gRPC
unary calls through the metrics interceptor vs a bare server.

``python -m bench.observability`` runs both pairs side by side, alternating rounds so a
noisy machine hits both sides alike, prints the ratios and writes
``bench/results/observability.json``. Goal: both ratios within a few percent of 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from bench.engine import BenchArgs, build, greedy_req, random_prompt
from services.common.rpc.metrics import RpcMetrics, RpcMetricsInterceptor
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.stats import SchedulerStats
from services.scheduler.transport.metrics import SchedulerMetrics

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class EngineRow:
    concurrency: int
    plain_step_ms: float  # median over rounds of the mean step time, stats discarded
    recorded_step_ms: float  # the same steps, stats recorded into Prometheus
    ratio: float  # recorded / plain: 1.0 is free
    record_us: float  # one SchedulerMetrics.record call, alone
    record_share: float  # record_us over the plain step time


@dataclass(slots=True)
class RpcRow:
    plain_us: float  # median over rounds of the mean unary round trip, no interceptor
    noop_us: float  # through an interceptor that does nothing: grpc.aio's own share
    intercepted_us: float  # through the metrics interceptor
    ratio: float  # intercepted / plain


def run_workload(
    scheduler: Scheduler, concurrency: int, output_len: int, on_stats: Callable
) -> float:
    """Mean seconds per step for ``concurrency`` greedy requests of ``output_len`` tokens."""
    rng = random.Random(concurrency)
    for i in range(concurrency):
        scheduler.add_request(greedy_req(f"r{i}", random_prompt(rng, 32), output_len))
    steps, start = 0, time.perf_counter()
    while scheduler.has_work:
        scheduler.step()
        on_stats(scheduler.take_stats())
        steps += 1
    elapsed = time.perf_counter() - start
    scheduler.flush_cache()
    return elapsed / steps


def bench_engine(args: argparse.Namespace) -> list[EngineRow]:
    scheduler = build(
        BenchArgs(
            model=args.model, device="cpu", dtype="float32", concurrency=args.concurrency,
            prompt_len=32, output_len=args.output_len, prefix_len=0, repeats=1,
            num_threads=args.num_threads, temperatures=[0.0],
        )
    )  # fmt: skip
    metrics = SchedulerMetrics("bench", CollectorRegistry())
    rows = []
    for concurrency in args.concurrency:
        run_workload(scheduler, concurrency, 4, lambda _s: None)  # warm-up
        plain, recorded = [], []
        for _ in range(args.rounds):
            plain.append(run_workload(scheduler, concurrency, args.output_len, lambda _s: None))
            recorded.append(run_workload(scheduler, concurrency, args.output_len, metrics.record))
        rows.append(
            EngineRow(
                concurrency=concurrency,
                plain_step_ms=statistics.median(plain) * 1e3,
                recorded_step_ms=statistics.median(recorded) * 1e3,
                ratio=statistics.median(recorded) / statistics.median(plain),
                record_us=(record_s := time_record(metrics, concurrency)) * 1e6,
                record_share=record_s / statistics.median(plain),
            )
        )
    return rows


def time_record(metrics: SchedulerMetrics, concurrency: int, repeats: int = 2000) -> float:
    """One decode step's hand-over: a token and an inter-token latency per request."""
    stats = SchedulerStats(
        num_generation_tokens=concurrency,
        step_tokens=[concurrency],
        inter_token_latency_s=[0.02] * concurrency,
    )
    start = time.perf_counter()
    for _ in range(repeats):
        metrics.record(stats)
    return (time.perf_counter() - start) / repeats


async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


class NoopInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001
        return await continuation(handler_call_details)


async def round_trip_s(interceptor: grpc.aio.ServerInterceptor | None, calls: int) -> float:
    server = grpc.aio.server(interceptors=[interceptor] if interceptor else [])
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/bench.Echo/Echo")
            await call(b"warm")
            start = time.perf_counter()
            for _ in range(calls):
                await call(b"x" * 64)
            return (time.perf_counter() - start) / calls
    finally:
        await server.stop(None)


async def bench_rpc(args: argparse.Namespace) -> RpcRow:
    plain, noop, intercepted = [], [], []
    for _ in range(args.rounds):
        plain.append(await round_trip_s(None, args.calls))
        noop.append(await round_trip_s(NoopInterceptor(), args.calls))
        metrics = RpcMetricsInterceptor(RpcMetrics(CollectorRegistry()))
        intercepted.append(await round_trip_s(metrics, args.calls))
    return RpcRow(
        plain_us=statistics.median(plain) * 1e6,
        noop_us=statistics.median(noop) * 1e6,
        intercepted_us=statistics.median(intercepted) * 1e6,
        ratio=statistics.median(intercepted) / statistics.median(plain),
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.observability", description=__doc__)
    p.add_argument("--model", default="models/tokenline-tiny")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "observability.json")
    args = p.parse_args(argv)
    engine = bench_engine(args)
    rpc = asyncio.run(bench_rpc(args))
    for row in engine:
        print(
            f"engine C={row.concurrency:<4} step {row.plain_step_ms:7.2f} ms plain, "
            f"{row.recorded_step_ms:7.2f} ms recorded  ratio {row.ratio:.3f}  "
            f"record() {row.record_us:.1f} us ({row.record_share:.2%} of a step)"
        )
    print(
        f"gRPC unary round trip {rpc.plain_us:.0f} us bare, {rpc.noop_us:.0f} us through a "
        f"no-op interceptor, {rpc.intercepted_us:.0f} us with metrics  ratio {rpc.ratio:.3f}"
    )
    result = {"engine": [asdict(r) for r in engine], "rpc": asdict(rpc)}
    result["args"] = {**vars(args), "out": str(args.out)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
