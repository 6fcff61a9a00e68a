"""What the service split costs: tokens/s through gateway + frontend + scheduler +
detokenizer, against the scheduler's engine alone, in one process, on the same work.

``python -m bench.split`` builds the engine exactly as the scheduler process does
(``build_scheduler`` with the same default flags), then alternates rounds: C requests of
the same token ids (``ignore_eos``, ``max_tokens`` = output length) stepped to the end
in-process, and the same C requests as streaming ``/v1/completions`` calls with token-id
prompts through the running stack. Both measure output tokens over the wall time from
the first submission to the last finish. Goal: stack / engine >= 0.85 at C = 64.

Every round ends by emptying both prefix caches: the engine alone's directly, the
stack's with ``POST /flush_cache``. Rounds reuse their prompts from cell to cell (round r
of every cell has seed r), and before the stack was flushed too its engine found every
prompt of the second cell cached and skipped its prefill while the engine alone did not:
the second cell read 0.84-0.89 where the first read 0.69-0.80, whichever temperature came
first. Each cell also starts with ``--warmup-rounds`` unmeasured pairs (default 1) at its
own concurrency, so neither side meets the cell's batch shapes for the first time while
measured.

Each cell also prints the CPU microseconds per output token of every process (read from
/proc over each round): the engine alone, and in the stack the engine process, each
service and this process as the load generator. At the end, ``bench.grpc_floor`` measures
grpc.aio streaming the same per-token message with nothing else running, beside what the
gateway (which reads such a stream) and the frontend (which writes it) spend per token.

``--stream-interval N`` runs both with the scheduler's flag of that name: every hop
after the engine then handles a row per N tokens instead of one per token.
``--overlap-schedule`` runs both with overlap scheduling.

Writes ``bench/results/split.json`` (``split-intervalN.json`` for N > 1, with
``-overlap`` before ``.json`` under ``--overlap-schedule``; ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.engine import bench_req, run_to_end
from bench.grpc_floor import measure_floor
from bench.machine import describe, machine_info
from bench.procs import cpu_seconds, stack_pids
from bench.serve.client import new_session
from bench.serve.report import write_json
from services.launch import LocalStack, StackPorts
from services.scheduler.__main__ import parse_args as scheduler_args
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.transport.engine_build import build_scheduler

RESULTS = Path("bench/results")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.split", description=__doc__)
    p.add_argument("--model", default="models/tokenline-tiny")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="engine/stack pairs per cell (single rounds read up to 0.3 apart on two shared cores)",
    )
    p.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        help="unmeasured engine/stack pairs at the cell's concurrency before its rounds",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the scheduler's --stream-interval, for the engine and the stack alike",
    )
    p.add_argument(
        "--overlap-schedule",
        action="store_true",
        help="the scheduler's --overlap-schedule, for the engine and the stack alike",
    )
    p.add_argument(
        "--no-multiplex",
        action="store_true",
        help="the gateway's --no-multiplex: one frontend RPC per stream, as before",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default bench/results/split[-intervalN][-overlap][-per-request].json)",
    )
    p.add_argument("--floor-messages", type=int, default=None, help="default: --output-len")
    return p.parse_args(argv)


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0, *(rng.randrange(1000, 30_000) for _ in range(length - 1))] for _ in range(num)]


@dataclass(slots=True)
class Round:
    """One run of a cell: output tokens/s, and CPU microseconds per output token of each
    process that took part (the engine alone: this process; the stack: its services, the
    engine process and this process as the load generator). ``first_tokens_s`` is when
    every request had its first token, from the first submission (the stack: when its
    client had it); ``elapsed_s`` the whole round. Before the first, a round pays each
    request's admission and prefill; after it, only decoding and delivery per token."""

    tok_s: float
    cpu_us_per_token: dict[str, float]
    first_tokens_s: float
    elapsed_s: float


class CpuMeter:
    """CPU time of named groups of processes, counted from when the meter is made."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        self._start = self._now()

    def _now(self) -> dict[str, float]:
        return {name: sum(map(cpu_seconds, pids)) for name, pids in self.pids.items()}

    def per_token_us(self, tokens: int) -> dict[str, float]:
        """Microseconds each group used since the meter was made, per output token."""
        end = self._now()
        return {name: (end[name] - self._start[name]) / tokens * 1e6 for name in end}


def run_engine(scheduler: Scheduler, ids: list[list[int]], out_len: int, temp: float) -> Round:
    """The engine alone on these prompts, submitted together."""
    tag = time.perf_counter()  # rids unique across rounds
    reqs = [bench_req(f"split-{tag}-{i}", prompt, out_len, temp) for i, prompt in enumerate(ids)]
    meter = CpuMeter({"engine": [os.getpid()]})
    submitted = time.time()  # the stamps in ``req.times`` are wall-clock
    produced, elapsed = run_to_end(scheduler, reqs)
    cpu = meter.per_token_us(produced)
    first_tokens = max(req.times.first_token or submitted for req in reqs) - submitted
    scheduler.flush_cache()  # the next round must not start from a warm prefix cache
    return Round(produced / elapsed, cpu, first_tokens, elapsed)


def run_stack(stack: LocalStack, ids: list[list[int]], out_len: int, temp: float) -> Round:
    """The same requests streamed through the gateway."""
    meter = CpuMeter(stack_pids(stack) | {"load generator": [os.getpid()]})
    start = time.perf_counter()
    tokens, first_tokens_at = asyncio.run(stream_all(stack.base_url, ids, out_len, temp))
    elapsed = time.perf_counter() - start
    cpu = meter.per_token_us(tokens)
    flush_stack_cache(stack)  # as the engine alone flushes: no round reuses another's prefill
    return Round(tokens / elapsed, cpu, first_tokens_at - start, elapsed)


def flush_stack_cache(stack: LocalStack, timeout_s: float = 10.0) -> None:
    """``POST /flush_cache``, retried while the scheduler still holds the round's requests
    (it refuses with 400 then, as SGLang does)."""
    url = stack.base_url.removesuffix("/v1") + "/flush_cache"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5):
                return
        except urllib.error.HTTPError as exc:
            if exc.code != 400 or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


async def stream_all(
    base_url: str, ids: list[list[int]], out_len: int, temp: float
) -> tuple[int, float]:
    """Output tokens of the requests, all streamed at once, and when (``perf_counter``)
    the last of them had its first token.

    aiohttp, as ``bench.serve``: the load generator shares the two cores with the stack,
    and httpx's pure-Python parsing of 4,096 frames cost more CPU than the detokenizer.
    """
    async with new_session(len(ids), timeout_s=600) as client:
        streams = await asyncio.gather(*(_stream(client, base_url, p, out_len, temp) for p in ids))
    return sum(tokens for tokens, _ in streams), max(first for _, first in streams)


async def _stream(
    client: aiohttp.ClientSession, base_url: str, prompt: list[int], out_len: int, temp: float
) -> tuple[int, float]:
    """The stream's output tokens, and when its first arrived: the gateway answers with
    its headers once the first chunk is there, so that is when ``post`` returns."""
    body = {
        "model": "tokenline-tiny",
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": temp,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tail = b""
    async with client.post(f"{base_url}/completions", json=body) as response:
        first_at = time.perf_counter()
        response.raise_for_status()
        # The token frames are read as they come and not split into lines: the load
        # generator shares the two cores, and only the closing usage frame is parsed.
        async for data in response.content.iter_any():
            tail = (tail + data)[-_TAIL_BYTES:]
    tokens = completion_tokens(tail)
    if tokens != out_len:
        raise RuntimeError(f"a request produced {tokens} tokens, expected {out_len}")
    return tokens, first_at


_TAIL_BYTES = 4096  # the end of a stream: its usage frame and ``[DONE]``


def completion_tokens(tail: bytes) -> int:
    """``usage.completion_tokens`` of the last usage frame in a stream's tail (0: none)."""
    for frame in reversed(tail.split(b"\n\n")):
        if frame.startswith(b"data: {") and b'"completion_tokens"' in frame:
            return int(json.loads(frame[len(b"data: ") :])["usage"]["completion_tokens"])
    return 0


def measure(args: argparse.Namespace, scheduler: Scheduler, stack: LocalStack) -> list[dict]:
    cells = []
    for temp in args.temperatures:
        for c in args.concurrency:
            for w in range(args.warmup_rounds):
                warm = prompts(c, args.input_len, seed=1_000 + w)
                run_engine(scheduler, warm, args.output_len, temp)
                run_stack(stack, warm, args.output_len, temp)
            engine, through_stack = [], []
            for r in range(args.rounds):
                ids = prompts(c, args.input_len, seed=r)
                engine.append(run_engine(scheduler, ids, args.output_len, temp))
                through_stack.append(run_stack(stack, ids, args.output_len, temp))
            cell = _cell(temp, c, engine, through_stack)
            print(
                f"T={temp:<4} C={c:<4} engine {cell['engine_tok_s']:8.1f} tok/s  stack "
                f"{cell['stack_tok_s']:8.1f} tok/s  ratio {cell['ratio']:.2f} "
                f"(rounds {', '.join(f'{x:.2f}' for x in cell['round_ratios'])})",
                flush=True,
            )
            print(f"    {cpu_line(cell)}", flush=True)
            print(f"    {phase_line(cell)}", flush=True)
            cells.append(cell)
    return cells


def _cell(temp: float, c: int, engine: list[Round], stack: list[Round]) -> dict[str, Any]:
    ratios = [s.tok_s / e.tok_s for s, e in zip(stack, engine, strict=True)]
    return {
        "temperature": temp,
        "concurrency": c,
        "engine_tok_s": statistics.median(e.tok_s for e in engine),
        "stack_tok_s": statistics.median(s.tok_s for s in stack),
        "ratio": statistics.median(ratios),
        "round_ratios": ratios,
        # Medians over rounds: how much CPU one output token cost each process.
        "engine_alone_cpu_us_per_token": _median_cpu(engine)["engine"],
        "stack_cpu_us_per_token": _median_cpu(stack),
        # Medians over rounds, in ms: until every request had its first token, and after.
        "phases_ms": {
            side: {
                "first_tokens": statistics.median(r.first_tokens_s for r in rounds) * 1e3,
                "after": statistics.median(r.elapsed_s - r.first_tokens_s for r in rounds) * 1e3,
            }
            for side, rounds in (("engine", engine), ("stack", stack))
        },
    }


def _median_cpu(rounds: list[Round]) -> dict[str, float]:
    names = rounds[0].cpu_us_per_token
    return {n: statistics.median(r.cpu_us_per_token[n] for r in rounds) for n in names}


def cpu_line(cell: dict[str, Any]) -> str:
    """Where the stack's CPU goes, beside the engine's own: the split costs what the other
    processes take, plus what the engine loses by sharing the cores with them."""
    stack = cell["stack_cpu_us_per_token"]
    parts = ", ".join(f"{name} {us:,.0f}" for name, us in stack.items())
    return (
        f"CPU us per output token: engine alone {cell['engine_alone_cpu_us_per_token']:,.0f}; "
        f"in the stack: {parts}"
    )


def phase_line(cell: dict[str, Any]) -> str:
    """Which part of a round the split slows: the part until every request has its first
    token (per-request work: the HTTP request, dispatch, prefill) or the decoding after it
    (per-token work: each step's rows through every hop)."""
    engine, stack = cell["phases_ms"]["engine"], cell["phases_ms"]["stack"]
    after = engine["after"] / stack["after"] if stack["after"] > 0 else float("nan")
    return (
        f"round (ms): until every first token engine {engine['first_tokens']:,.0f}, stack "
        f"{stack['first_tokens']:,.0f}; after it engine {engine['after']:,.0f}, stack "
        f"{stack['after']:,.0f} (the stack at {after:.2f}x the engine's pace)"
    )


def floor_line(floor: dict[str, float], cells: list[dict[str, Any]]) -> str:
    """The gRPC hop alone beside what the gateway (its reader) and the frontend (its writer)
    spend per streamed token, in the first cell."""
    read, write = floor["client_read_us_per_message"], floor["server_write_us_per_message"]
    stack = cells[0]["stack_cpu_us_per_token"]
    return (
        f"gRPC floor (grpc.aio alone, the same message): read {read:.0f} us, write {write:.0f} "
        f"us per message; per token the gateway spends {stack['gateway']:.0f} "
        f"({_times(stack['gateway'], read, 'read')}), the frontend {stack['frontend']:.0f} "
        f"({_times(stack['frontend'], write, 'write')})"
    )


def _times(cost: float, floor: float, what: str) -> str:
    """``cost`` as a multiple of the ``what`` floor; a short run can read a floor of 0 (less
    CPU than one /proc clock tick), which is said rather than divided by."""
    return f"{cost / floor:.1f}x the {what}" if floor > 0 else f"the {what} under one clock tick"


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The scheduler flags the in-process engine and the stack's scheduler both get."""
    flags = ["--stream-interval", str(args.stream_interval)]
    return flags + (["--overlap-schedule"] if args.overlap_schedule else [])


def default_out(args: argparse.Namespace) -> Path:
    interval = "" if args.stream_interval == 1 else f"-interval{args.stream_interval}"
    overlap = "-overlap" if args.overlap_schedule else ""
    transport = "-per-request" if args.no_multiplex else ""
    return RESULTS / f"split{interval}{overlap}{transport}.json"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_info()
    print(f"machine: {describe(machine)}", flush=True)
    flags = engine_flags(args)
    scheduler, dtype = build_scheduler(scheduler_args(["--model", args.model, *flags]))
    out = args.out or default_out(args)
    stack = LocalStack(
        args.model,
        StackPorts.free(),
        log_dir=out.parent / "split-logs",
        scheduler_args=flags,
        gateway_args=["--no-multiplex"] if args.no_multiplex else [],
    )
    stack.start(timeout=300)
    try:
        run_engine(scheduler, prompts(4, args.input_len, seed=99), 8, 1.0)  # warm-up
        run_stack(stack, prompts(4, args.input_len, seed=99), 8, 1.0)
        cells = measure(args, scheduler, stack)
    finally:
        stack.stop()
    floor = measure_floor(max(args.concurrency), args.floor_messages or args.output_len)
    print(floor_line(floor, cells), flush=True)
    report = {
        "machine": machine,
        "dtype": dtype,
        "args": vars(args) | {"out": str(out)},
        "cells": cells,
        "grpc_floor_us_per_message": floor,
    }
    write_json(report, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
