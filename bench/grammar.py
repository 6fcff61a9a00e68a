"""Grammar-constrained decoding: what the mask costs per step, and what a compile costs.

``python -m bench.grammar`` measures, side by side in one run:

* 32 requests decoding together, every one constrained by a typical JSON schema (nested
  object, enum, bounded strings and array), against the same 32 requests unconstrained
  (same prompts, same seeds), runs alternating. Per all-decode step: the whole ``step()``
  and, inside it, the grammar's time on the engine's path: waiting for the 32 bitmasks
  (filled on a worker beside the forward), applying them to the logits, and advancing the
  32 matchers. Goal: that time <= 10 % of a constrained step.
* Compile times of that schema: the frontend's check (grammar from the schema, no
  vocabulary), the scheduler's cold compile against the model's vocabulary, and a cache
  hit; plus the one-off ``TokenizerInfo`` build.

Writes ``bench/results/grammar.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xgrammar

from bench.engine import BenchArgs, build, random_prompt
from bench.machine import describe, machine_info
from services.common.grammar import build_grammar, choice_ebnf
from services.common.sampling_params import GrammarSpec, SamplingParams
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.sampling.grammar import GrammarMasker

RESULTS = Path(__file__).resolve().parent / "results"

TYPICAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
        "status": {"enum": ["active", "suspended", "deleted"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 30},
                "country": {"type": "string", "minLength": 2, "maxLength": 2},
            },
            "required": ["street", "city", "country"],
        },
        "score": {"type": "number"},
    },
    "required": ["id", "name", "status", "address"],
}
OTHER_SPECS = {
    "json_object": GrammarSpec("json_schema", '{"type": "object"}'),
    "regex": GrammarSpec("regex", r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{2})?"),
    "choice": GrammarSpec("ebnf", choice_ebnf(["red", "green", "blue"])),
}


@dataclass(slots=True)
class StepTimes:
    """Per all-decode step. The engine's own path: prepare + mask + accept (serial); the
    mask is built (bitmask fill and expansion) on the masker's worker beside the forward,
    and added to the logits (apply) inside ``mask``."""

    step_s: list[float] = field(default_factory=list)
    prepare_s: list[float] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)
    accept_s: list[float] = field(default_factory=list)
    apply_s: list[float] = field(default_factory=list)
    build_s: list[float] = field(default_factory=list)

    def buckets(self) -> list[list[float]]:
        return [self.prepare_s, self.mask_s, self.accept_s, self.apply_s, self.build_s]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__)
    p.add_argument("--model", default="models/tokenline-tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="alternating run pairs")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--num-threads", type=int, default=0)
    return p.parse_args()


def timed(fn: Callable[..., Any], bucket: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        bucket.append(time.perf_counter() - t0)
        return result

    return wrapper


class TimedMasker:
    """The logits processor's GrammarMasker with its call timed (a special method cannot be
    wrapped on the instance)."""

    def __init__(self, masker: GrammarMasker, bucket: list[float]) -> None:
        self.prefetch = masker.prefetch
        self._call = timed(masker, bucket)

    def __call__(self, logits: torch.Tensor, reqs: Any) -> None:
        self._call(logits, reqs)


def instrument(scheduler: Scheduler, times: StepTimes) -> None:
    """Time the grammar's pieces inside the engine's own step (instance wrappers)."""
    sampler = scheduler.sampler
    processor = sampler.processor
    masker = GrammarMasker()  # fresh wrappers each run; the buffers are refilled at once
    masker.build = timed(masker.build, times.build_s)  # type: ignore[method-assign]
    masker.apply = timed(masker.apply, times.apply_s)  # type: ignore[method-assign]
    processor.grammar_mask = TimedMasker(masker, times.mask_s)  # type: ignore[assignment]
    processor.record = timed(type(processor).record.__get__(processor), times.accept_s)  # type: ignore[method-assign]
    sampler.prepare = timed(type(sampler).prepare.__get__(sampler), times.prepare_s)  # type: ignore[method-assign]


def run(
    scheduler: Scheduler, args: argparse.Namespace, seed: int, spec: GrammarSpec | None
) -> StepTimes:
    """C requests submitted together; every step where all C decode is kept."""
    times = StepTimes()
    instrument(scheduler, times)
    rng = random.Random(seed)
    for i in range(args.concurrency):
        params = SamplingParams(
            temperature=args.temperature, max_new_tokens=args.output_len, seed=seed * 1000 + i
        )
        if spec is not None:
            setattr(params, spec.kind, spec.text)
        scheduler.add_request(Req(f"r{i}", random_prompt(rng, args.prompt_len), params))
    while scheduler.has_work:
        running = scheduler.running
        is_decode = len(running) == args.concurrency and all(r.num_uncomputed == 1 for r in running)
        before = [len(bucket) for bucket in times.buckets()]
        t0 = time.perf_counter()
        scheduler.step()
        elapsed = time.perf_counter() - t0
        if is_decode:
            times.step_s.append(elapsed)
        else:  # a step with prefill in it: only all-decode steps are compared
            for bucket, num in zip(times.buckets(), before, strict=True):
                del bucket[num:]
    scheduler.flush_cache()
    return times


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else 0.0


def serial_ms(times: StepTimes) -> float:
    """The grammar's time on the engine's path per step: prepare + mask + accept."""
    return ms(times.prepare_s) + ms(times.mask_s) + ms(times.accept_s)


def measure_mask(scheduler: Scheduler, args: argparse.Namespace) -> dict[str, float]:
    spec = GrammarSpec("json_schema", json.dumps(TYPICAL_SCHEMA))
    scheduler.grammars.compile_now(spec)
    run(scheduler, args, 99, spec)  # warm-up
    constrained, plain = StepTimes(), StepTimes()
    for r in range(args.repeats):
        for target, grammar in ((constrained, spec), (plain, None)):
            got = run(scheduler, args, r, grammar)
            target.step_s += got.step_s
            for mine, theirs in zip(target.buckets(), got.buckets(), strict=True):
                mine += theirs
    result = {
        "steps_measured": len(constrained.step_s),
        "constrained_step_ms": ms(constrained.step_s),
        "plain_step_ms": ms(plain.step_s),
        "grammar_serial_ms": serial_ms(constrained),
        "prepare_ms": ms(constrained.prepare_s),
        "mask_ms": ms(constrained.mask_s),
        "apply_ms": ms(constrained.apply_s),
        "accept_ms": ms(constrained.accept_s),
        "build_beside_forward_ms": ms(constrained.build_s),
        "plain_grammar_hooks_ms": serial_ms(plain),
    }
    result["grammar_share_of_step"] = result["grammar_serial_ms"] / result["constrained_step_ms"]
    result["constrained_over_plain"] = result["constrained_step_ms"] / result["plain_step_ms"]
    print(
        f"C={args.concurrency}, every request constrained: step "
        f"{result['constrained_step_ms']:.2f} ms vs {result['plain_step_ms']:.2f} ms "
        f"unconstrained (ratio {result['constrained_over_plain']:.2f})\n"
        f"  grammar on the engine's path {result['grammar_serial_ms']:.2f} ms = "
        f"{result['grammar_share_of_step']:.1%} of a step (mask {result['mask_ms']:.2f}, of "
        f"which apply {result['apply_ms']:.2f}; accept {result['accept_ms']:.2f}; prepare "
        f"{result['prepare_ms']:.3f}); mask built in {result['build_beside_forward_ms']:.2f} "
        f"ms beside the forward\n  unconstrained batch: grammar hooks "
        f"{result['plain_grammar_hooks_ms']:.3f} ms",
        flush=True,
    )
    return result


def median_ms(fn: Callable[[], Any], trials: int = 10) -> float:
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def measure_compile(scheduler: Scheduler) -> dict[str, Any]:
    compiler = scheduler.grammars
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(
        scheduler.stop_checker.tokenizer, vocab_size=compiler.vocab_size
    )
    info_ms = (time.perf_counter() - t0) * 1e3
    cold = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    specs = {"typical_schema": GrammarSpec("json_schema", json.dumps(TYPICAL_SCHEMA))}
    specs |= OTHER_SPECS
    result: dict[str, Any] = {"tokenizer_info_ms": info_ms}
    for name, spec in specs.items():
        compiler.compile_now(spec)
        result[name] = {
            "frontend_check_ms": median_ms(lambda spec=spec: build_grammar(spec)),
            "cold_compile_ms": median_ms(
                lambda spec=spec: cold.compile_grammar(build_grammar(spec))
            ),
            "cache_hit_ms": median_ms(lambda spec=spec: compiler.get(spec).result()),
        }
        row = result[name]
        print(
            f"{name:15s} frontend check {row['frontend_check_ms']:7.2f} ms  cold compile "
            f"{row['cold_compile_ms']:7.2f} ms  cache hit {row['cache_hit_ms']:.4f} ms",
            flush=True,
        )
    print(f"TokenizerInfo (once per scheduler): {info_ms:.0f} ms", flush=True)
    return result


def main() -> None:
    args = parse_args()
    engine_args = BenchArgs(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        concurrency=[args.concurrency],
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        prefix_len=0,
        repeats=args.repeats,
        num_threads=args.num_threads,
        temperatures=[args.temperature],
    )
    scheduler = build(engine_args)
    machine = machine_info()
    print(f"machine: {describe(machine)}", flush=True)
    report = {
        "args": vars(args),
        "machine": machine,
        "compile": measure_compile(scheduler),
        "mask": measure_mask(scheduler, args),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "grammar.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
