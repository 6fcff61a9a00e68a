"""Prepared checks for a machine with a CUDA GPU: ``python -m bench.gpu_check``.

1. Greedy parity with the CPU: the same prompts decoded greedily by the engine on the GPU
   and on the same machine's CPU, both in float32 (bf16 rounds differently on each device
   by design): how many leading tokens agree per prompt, and the largest difference between
   the two devices' logits of the prompts' last tokens.
2. Decode throughput at C = 1, 32 and 128, T = 1.0 and 0, at dtype auto (bf16 on a GPU
   that has it): the engine against the bare forward of the same batch (``bench.engine``'s
   measure), for each attention backend that builds: torch SDPA always, ``flash_attn`` when
   vllm-flash-attn or flash-attn is installed (else the reason it is not).
3. Overlap scheduling: the same runs with and without ``overlap_schedule`` (torch SDPA),
   where the GPU computes while the host plans and commits (``bench.engine``'s measure).

Writes ``bench/results/gpu_check.json`` (or ``--out``). Without CUDA it says so and exits 2:
there is nothing to check. ``--device cpu`` runs the same code on the CPU alone, which is
how the test suite keeps it working between GPU loans. docs/benchmarks.md, "On a GPU", says how to
run it on a lent machine.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.engine import (
    BenchArgs,
    build,
    greedy_req,
    measure_overlap,
    measure_throughput,
    random_prompt,
    run_to_end,
    split_slots,
)
from bench.machine import describe, machine_info
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.model_executor.attention import ATTENTION_BACKENDS, create_attention_backend
from services.scheduler.model_executor.model_runner import ForwardPlan
from services.scheduler.model_executor.models.dtype import AUTO

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    p.add_argument("--model", default="models/tokenline-tiny")
    p.add_argument("--device", default="cuda")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    p.add_argument("--parity-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per parity prompt")
    p.add_argument(
        "--output-len", type=int, default=32, help="decode tokens per throughput request"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    return p.parse_args(argv)


def _bench_args(
    model: str,
    device: str,
    dtype: str,
    concurrency: list[int],
    temperatures: list[float],
    backend: str,
    output_len: int = 32,
) -> BenchArgs:
    return BenchArgs(
        model=model,
        device=device,
        dtype=dtype,
        concurrency=concurrency,
        prompt_len=64,
        output_len=output_len,
        prefix_len=0,
        repeats=2,
        num_threads=0,
        temperatures=temperatures,
        attention_backend=backend,
    )


def last_token_logits(scheduler: Scheduler, prompts: list[list[int]]) -> torch.Tensor:
    """float32 logits [len(prompts), vocab] of each prompt's last token, on the CPU."""
    lengths = [len(p) for p in prompts]
    slots = scheduler.kv_pool.allocate(sum(lengths))
    per_prompt = split_slots(slots, lengths)
    plan = ForwardPlan(
        [list(p) for p in prompts], [0] * len(prompts), per_prompt, [*range(len(prompts))]
    )
    logits = scheduler.runner.forward(plan).cpu()
    scheduler.kv_pool.free(slots)
    return logits


def greedy_run(
    model: str, device: str, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], torch.Tensor]:
    """Each prompt's greedy tokens, and its last prompt token's logits, in float32."""
    scheduler = build(_bench_args(model, device, "float32", [len(prompts)], [0.0], "torch"))
    logits = last_token_logits(scheduler, prompts)
    reqs = [greedy_req(f"parity{i}", prompt, new_tokens) for i, prompt in enumerate(prompts)]
    run_to_end(scheduler, reqs)
    return [list(r.output_ids) for r in reqs], logits


def parity(model: str, device: str, num_prompts: int, new_tokens: int) -> dict[str, Any]:
    """``device`` against the CPU on the same prompts, greedy, float32."""
    rng = random.Random(11)
    prompts = [random_prompt(rng, rng.randrange(16, 96)) for _ in range(num_prompts)]
    theirs, their_logits = greedy_run(model, device, prompts, new_tokens)
    ours, our_logits = greedy_run(model, "cpu", prompts, new_tokens)
    agreeing = [_common_prefix(a, b) for a, b in zip(theirs, ours, strict=True)]
    return {
        "prompts": num_prompts,
        "new_tokens": new_tokens,
        "agreeing_prefix": agreeing,
        "all_equal": theirs == ours,
        "last_token_logits_max_abs_diff": float((their_logits - our_logits).abs().max()),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def backend_status(device: str) -> dict[str, str]:
    """Each attention backend: "ok", or why it does not build here."""
    status = {}
    for name in ATTENTION_BACKENDS:
        try:
            create_attention_backend(name, device)
            status[name] = "ok"
        except (RuntimeError, ValueError) as exc:
            status[name] = f"unavailable: {exc}"
    return status


def _throughput_args(args: argparse.Namespace, backend: str) -> BenchArgs:
    """The engine benchmark's settings for the throughput and overlap rows."""
    return _bench_args(
        args.model,
        args.device,
        AUTO,
        args.concurrency,
        args.temperatures,
        backend,
        args.output_len,
    )


def throughput(args: argparse.Namespace, backends: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for backend, state in backends.items():
        if state != "ok":
            continue
        print(f"-- attention backend {backend}", flush=True)
        bench = _throughput_args(args, backend)
        scheduler = build(bench)
        rows += [
            asdict(r) | {"attention_backend": backend} for r in measure_throughput(scheduler, bench)
        ]
        del scheduler
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def overlap(args: argparse.Namespace) -> list[dict[str, Any]]:
    print("-- overlap scheduling (torch attention)", flush=True)
    bench = _throughput_args(args, "torch")
    return [asdict(r) for r in measure_overlap(build(bench), bench)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (run it on a GPU; see docs/benchmarks.md)")
        return 2
    machine = machine_info()
    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None
    print(f"machine: {describe(machine)}; device {args.device} ({gpu or 'CPU'})", flush=True)
    checked = parity(args.model, args.device, args.parity_prompts, args.new_tokens)
    print(
        f"greedy parity with the CPU (float32): all equal {checked['all_equal']}, agreeing "
        f"prefixes {checked['agreeing_prefix']} of {args.new_tokens}, last-token logits max "
        f"|diff| {checked['last_token_logits_max_abs_diff']:.2e}",
        flush=True,
    )
    backends = backend_status(args.device)
    print(f"attention backends: {backends}", flush=True)
    report = {
        "machine": machine,
        "device": args.device,
        "gpu": gpu,
        "torch": torch.__version__,
        "parity": checked,
        "attention_backends": backends,
        "throughput": throughput(args, backends),
        "overlap": overlap(args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
