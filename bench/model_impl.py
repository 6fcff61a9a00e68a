"""The native path against the transformers path on one checkpoint, in process.

``python -m bench.model_impl [--model DIR]`` times ``ModelRunner.run`` (the forward and
the LM head of the sampled rows, no scheduling or sampling) for a prefill of
``--prompt-len`` tokens and for decode steps of C requests at that context, on both
paths, alternating which runs first; prints the median milliseconds and the ratio.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Mapping

import torch

from bench.machine import describe, machine_info
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.model_runner import ForwardPlan, ModelRunner
from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.transport.heap import keep_heap

PATHS = ("native", "transformers")


def create_runner(
    model_dir: str, path: str, num_tokens: int, dtype: torch.dtype = torch.float32
) -> ModelRunner:
    model, config = load_model(model_dir, dtype, "cpu", model_impl=path)
    pool = KVPool(num_tokens, config.num_layers, config.num_kv_heads, config.head_dim, dtype)
    return ModelRunner(model, pool, "cpu")


def prefill_plan(prompt_len: int) -> ForwardPlan:
    ids = [(7 * i) % 1000 + 10 for i in range(prompt_len)]
    return ForwardPlan([ids], [0], [list(range(prompt_len))], logit_rows=[0])


def decode_plan(num_reqs: int, context: int) -> ForwardPlan:
    """``num_reqs`` requests each adding one token after ``context - 1`` cached ones (the
    cache is whatever the pool holds: timing does not depend on its values)."""
    slots = [list(range(r * context, (r + 1) * context)) for r in range(num_reqs)]
    return ForwardPlan(
        [[100 + r] for r in range(num_reqs)],
        [context - 1] * num_reqs,
        slots,
        logit_rows=list(range(num_reqs)),
    )


def median_ms(steps: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each step, the steps interleaved (and their order alternated)
    so that load from other processes falls on both alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for i in range(repeats):
        for name in sorted(steps, reverse=bool(i % 2)):
            start = time.perf_counter()
            steps[name]()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="models/tokenline-tiny")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    keep_heap()  # as the scheduler's engine process does by default
    num_tokens = max(args.concurrency) * args.prompt_len
    dtype = getattr(torch, args.dtype)
    runners = {path: create_runner(args.model, path, num_tokens, dtype) for path in PATHS}
    cases = {"prefill": prefill_plan(args.prompt_len)}
    cases.update({f"decode C={c}": decode_plan(c, args.prompt_len) for c in args.concurrency})
    print(describe(machine_info()), f"torch threads {args.num_threads}, {args.dtype}")
    for name, plan in cases.items():
        steps = {path: functools.partial(runners[path].run, plan) for path in PATHS}
        ms = median_ms(steps, args.repeats)
        ratio = ms["transformers"] / ms["native"]
        print(
            f"{name:14s} native {ms['native']:8.2f} ms  transformers "
            f"{ms['transformers']:8.2f} ms  transformers/native {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
