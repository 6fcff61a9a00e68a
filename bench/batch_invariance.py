"""What ``--batch-invariant`` costs: the model forward with and without it, side by side.

``python -m bench.batch_invariance --model DIR`` loads the model twice (the default mode and
batch-invariant: fixed row tiles in every matmul, decode attention per request), then
times, alternating the two in each round so a noisy machine slows both alike:

* a decode step of C requests (C = 1, 8, 32, 64) at a 128-token context;
* the prefill of one 512-token prompt.

Both modes use the compiled decode attention where it is built (it is per request, so
invariant already); what differs is the linear layers' row tiles.

It prints the median time of each and the ratio invariant / default, and writes
``bench/results/batch_invariance.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.machine import describe, machine_info
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.model_runner import ForwardPlan, ModelRunner
from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.ops.cpu_kernels import SampleKernel, is_registered

CONTEXT = 128
PROMPT = 512


def runner_for(model_dir: str, dtype: str, batch_invariant: bool) -> ModelRunner:
    """The model in one mode, with the compiled decode attention where it is built for this
    machine, as a serving scheduler runs it (``make kernels``)."""
    model, config = load_model(model_dir, dtype, "cpu", batch_invariant=batch_invariant)
    if SampleKernel.load(model_dir) is not None and is_registered("decode_attention"):
        model.attn_backend.decode_kernel = True  # type: ignore[attr-defined]
    tokens = 64 * (CONTEXT + 1) + PROMPT
    pool_dtype = model.model.embed_tokens.weight.dtype
    pool = KVPool(tokens, config.num_layers, config.num_kv_heads, config.head_dim, pool_dtype)
    return ModelRunner(model, pool, "cpu")


def decode_plan(num_reqs: int) -> ForwardPlan:
    """C requests, each with a 128-token context, adding one token."""
    slots = [list(range(r * (CONTEXT + 1), (r + 1) * (CONTEXT + 1))) for r in range(num_reqs)]
    return ForwardPlan([[7]] * num_reqs, [CONTEXT] * num_reqs, slots, list(range(num_reqs)))


def prefill_plan() -> ForwardPlan:
    start = 64 * (CONTEXT + 1)
    return ForwardPlan([[7] * PROMPT], [0], [list(range(start, start + PROMPT))], [0])


def seconds(runner: ModelRunner, plan: ForwardPlan) -> float:
    started = time.perf_counter()
    runner.forward(plan)
    return time.perf_counter() - started


def compare(
    runners: dict[str, ModelRunner], plans: dict[str, ForwardPlan], rounds: int
) -> dict[str, dict[str, float]]:
    """Median seconds of each plan in each mode, the modes alternating within a round."""
    times: dict[str, dict[str, list[float]]] = {p: {m: [] for m in runners} for p in plans}
    for r in range(rounds):
        modes = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name, plan in plans.items():
            for mode in modes:
                times[name][mode].append(seconds(runners[mode], plan))
    median: Callable[[list[float]], float] = statistics.median
    return {p: {m: median(v) for m, v in by_mode.items()} for p, by_mode in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tokenline-tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path("bench/results/batch_invariance.json"))
    args = p.parse_args(argv)
    runners = {
        mode: runner_for(args.model, args.dtype, mode == "invariant")
        for mode in ("default", "invariant")
    }
    plans = {f"decode C={c}": decode_plan(c) for c in (1, 8, 32, 64)}
    plans["prefill 512"] = prefill_plan()
    for runner in runners.values():  # warm-up: oneDNN builds its kernels on first use
        for plan in plans.values():
            runner.forward(plan)
    result = compare(runners, plans, args.rounds)
    print(describe(machine_info()))
    print(f"{'step':<14} {'default ms':>11} {'invariant ms':>13} {'ratio':>6}")
    for name, by_mode in result.items():
        ratio = by_mode["invariant"] / by_mode["default"]
        print(
            f"{name:<14} {by_mode['default'] * 1e3:11.2f} {by_mode['invariant'] * 1e3:13.2f} "
            f"{ratio:6.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_info(), "model": args.model, "dtype": args.dtype}
    args.out.write_text(json.dumps(report | {"seconds": result}, indent=2))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
