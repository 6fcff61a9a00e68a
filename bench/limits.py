"""How near tokenline runs to this machine's limits: decode against memory bandwidth,
prefill against GEMM throughput (issue #36, items 2 and 3).

``python -m bench.limits --model models/tokenline-small`` measures, in one run:

* **copy bandwidth**: a 512 MiB tensor copied into another, counted as STREAM counts a
  copy (bytes read plus bytes written, per second; best of several): the ceiling for
  streaming weights;
* **GEMM throughput**: the model's own linear layers (the same modules, packed as the
  scheduler packs them) on a prefill chunk's row count, FLOPs per second: the ceiling for
  prefill;
* **decode at C = 1**: the bare forward of one token (all layers and the LM head) and the
  engine's whole ``step()`` at a short context, as weight bytes streamed per second; with
  decode copies (the scheduler's ``--decode-copy``, kept by default without AMX, else where
  they fit), once on the copies and once on a second load of the model with oneDNN's packed
  weights alone, alternating, and their ratio;
* **prefill**: one long prompt prefilled through the scheduler's chunked steps, as prompt
  tokens/s times FLOPs per token (linear layers plus causal attention) over the GEMM
  throughput.

Each figure is a ratio of two measurements taken in this run, on this CPU. Writes JSON
(``--out``, default ``bench/results/limits.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.engine import BenchArgs, bare_forward, bench_req, build, random_prompt
from bench.machine import describe, machine_info
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.model_executor.models.linear import Linear

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class Limits:
    copy_gb_s: float  # bytes read + written per second copying a 512 MiB tensor (STREAM's)
    gemm_tflops: float  # the model's linear layers at the prefill chunk's rows
    gemm_rows: int


@dataclass(frozen=True, slots=True)
class Decode:
    weight_gb: float  # linear weights read per decode token (LM head included)
    forward_ms: float  # bare forward of one token
    step_ms: float  # the engine's whole step() for that token (sampling and commit too)
    forward_gb_s: float
    step_gb_s: float
    forward_of_copy: float  # forward_gb_s / copy bandwidth: the goal is >= 0.7
    step_of_copy: float


@dataclass(frozen=True, slots=True)
class Prefill:
    prompt_tokens: int
    chunk_tokens: int
    seconds: float
    tokens_per_s: float
    gflop_per_token: float  # linear layers plus causal attention, averaged over the prompt
    tflops: float
    of_gemm: float  # tflops / the GEMM throughput: the goal is >= 0.8


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls (after one warm-up): the machine is shared."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def copy_bandwidth(mib: int = 512, repeats: int = 10) -> float:
    src = torch.ones(mib * 1024 * 1024 // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def linears(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def linear_flops(layer: Linear, rows: int) -> float:
    return 2.0 * rows * layer.in_features * layer.out_features


def gemm_throughput(model: torch.nn.Module, rows: int, dtype: torch.dtype) -> float:
    """FLOP/s of one decoder layer's linears plus the LM head, each on ``rows`` rows,
    through the modules the model runs (packed weights included): best of 5 per shape."""
    seen: dict[tuple[int, int], Linear] = {}
    for layer in linears(model):
        seen.setdefault((layer.in_features, layer.out_features), layer)
    flops = seconds = 0.0
    with torch.inference_mode():
        for layer in seen.values():
            x = torch.randn(rows, layer.in_features, dtype=dtype)
            seconds += best_seconds(lambda layer=layer, x=x: layer(x), 5)
            flops += linear_flops(layer, rows)
    return flops / seconds


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return sum(layer.in_features * layer.out_features * size for layer in linears(model))


def measure_decode(scheduler: Scheduler, context: int, copy_gb_s: float, repeats: int) -> Decode:
    model = scheduler.runner.model
    dtype = next(model.parameters()).dtype
    gb = weight_bytes(model, dtype) / 1e9
    scratch = scheduler.kv_pool.allocate(context)
    forward_s = best_seconds(lambda: bare_forward(scheduler, [context], scratch, "cpu"), repeats)
    scheduler.kv_pool.free(scratch)
    step_s = engine_decode_step(scheduler, context, repeats)
    return Decode(
        weight_gb=gb,
        forward_ms=forward_s * 1e3,
        step_ms=step_s * 1e3,
        forward_gb_s=gb / forward_s,
        step_gb_s=gb / step_s,
        forward_of_copy=gb / forward_s / copy_gb_s,
        step_of_copy=gb / step_s / copy_gb_s,
    )


def count_decode_copies(model: torch.nn.Module) -> int:
    """The modules that hold decode copies: a ``Linear`` with its ``decode_copy``, MoE
    experts with their ``decode_copies``."""
    return sum(
        1
        for module in model.modules()
        for attribute in ("decode_copy", "decode_copies")
        if getattr(module, attribute, None) is not None
    )


def measure_decode_both(
    packed_only: Scheduler, copied: Scheduler, context: int, copy_gb_s: float, repeats: int
) -> tuple[Decode, Decode]:
    """(oneDNN's packed weights alone, with the decode copies), each on its own scheduler
    (without AMX the copies replace the packed weights): two alternating rounds each, the
    faster kept."""
    rounds: dict[str, list[Decode]] = {"packed": [], "copy": []}
    for _ in range(2):
        rounds["packed"].append(measure_decode(packed_only, context, copy_gb_s, repeats))
        rounds["copy"].append(measure_decode(copied, context, copy_gb_s, repeats))
    packed, copied = (min(runs, key=lambda d: d.forward_ms) for runs in rounds.values())
    return packed, copied


def engine_decode_step(scheduler: Scheduler, context: int, steps: int) -> float:
    """Median seconds of the engine's decode steps for one greedy request."""
    rng = random.Random(1)
    scheduler.add_request(bench_req("decode", random_prompt(rng, context), steps + 1, 0.0))
    times = []
    while scheduler.has_work:
        decoding = all(r.num_uncomputed == 1 for r in scheduler.running)
        t0 = time.perf_counter()
        scheduler.step()
        if decoding and scheduler.running:
            times.append(time.perf_counter() - t0)
    scheduler.flush_cache()
    return statistics.median(times)


def prefill_flops_per_token(model: torch.nn.Module, prompt_tokens: int) -> float:
    """Linear layers (LM head excluded: a prefill computes logits for its last token
    only) plus causal attention's two matmuls at the prompt's mean context."""
    config = model.config
    dense = sum(linear_flops(layer, 1) for layer in linears(model) if layer is not model.lm_head)
    mean_context = (prompt_tokens + 1) / 2
    attention = 4.0 * config.num_layers * config.num_heads * config.head_dim * mean_context
    return dense + attention


def measure_prefill(
    scheduler: Scheduler, prompt_tokens: int, gemm_flops: float, repeats: int
) -> Prefill:
    rng = random.Random(2)

    def prefill_once() -> None:
        req = bench_req("prefill", random_prompt(rng, prompt_tokens), 1, 0.0)
        scheduler.add_request(req)
        while scheduler.has_work:
            scheduler.step()
        scheduler.flush_cache()

    seconds = best_seconds(prefill_once, repeats)
    per_token = prefill_flops_per_token(scheduler.runner.model, prompt_tokens)
    tflops = prompt_tokens * per_token / seconds / 1e12
    return Prefill(
        prompt_tokens=prompt_tokens,
        chunk_tokens=scheduler.config.max_num_batched_tokens,
        seconds=seconds,
        tokens_per_s=prompt_tokens / seconds,
        gflop_per_token=per_token / 1e9,
        tflops=tflops,
        of_gemm=tflops * 1e12 / gemm_flops,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.limits", description=__doc__)
    p.add_argument("--model", default="models/tokenline-small")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=128, help="decode context length")
    p.add_argument("--prompt-len", type=int, default=2048, help="the prefilled prompt")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--copy-mib", type=int, default=512, help="the copied tensor: far above any cache"
    )
    p.add_argument(
        "--gemm-rows", type=int, default=0, help="rows of the GEMM bound (0: the prefill chunk)"
    )
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument(
        "--decode-copy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the scheduler's --decode-copy (default: its auto choice); where the model has "
        "decode copies, decode is measured with and without them",
    )
    p.add_argument(
        "--heap-tuning",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as the scheduler's --heap-tuning (services/scheduler/transport/heap.py)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "limits.json")
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of one run, as the JSON report holds them."""
    bench_args = BenchArgs(
        model=args.model,
        device="cpu",
        dtype=args.dtype,
        concurrency=[1],
        prompt_len=args.prompt_len,
        output_len=args.repeats + 2,
        prefix_len=0,
        repeats=1,
        num_threads=args.num_threads,
        temperatures=[0.0],
        heap_tuning=args.heap_tuning,
        decode_copy=args.decode_copy,
    )
    scheduler = build(bench_args)
    model = scheduler.runner.model
    dtype = next(model.parameters()).dtype
    machine = machine_info()
    print(f"machine: {describe(machine)}", flush=True)
    rows = args.gemm_rows or scheduler.config.max_num_batched_tokens
    limits = Limits(copy_bandwidth(args.copy_mib), gemm_throughput(model, rows, dtype) / 1e12, rows)
    print(
        f"limits: copy {limits.copy_gb_s:.1f} GB/s (read + written); the model's GEMMs at "
        f"{rows} rows {limits.gemm_tflops:.2f} TFLOP/s ({str(dtype).removeprefix('torch.')})",
        flush=True,
    )
    copies = count_decode_copies(model)
    packed = None
    if copies:
        packed_only = build(dataclasses.replace(bench_args, decode_copy=False))
        packed, decode = measure_decode_both(
            packed_only, scheduler, args.context, limits.copy_gb_s, args.repeats
        )
        del packed_only
        print_decode("decode C=1, oneDNN's packed weights", packed)
        print_decode(f"decode C=1, decode copies in {copies} modules", decode)
        print(f"decode copies / packed forward time: {decode.forward_ms / packed.forward_ms:.2f}")
    else:
        decode = measure_decode(scheduler, args.context, limits.copy_gb_s, args.repeats)
        print_decode("decode C=1", decode)
    prefill = measure_prefill(scheduler, args.prompt_len, limits.gemm_tflops * 1e12, 3)
    print(
        f"prefill {prefill.prompt_tokens} tokens in chunks of {prefill.chunk_tokens}: "
        f"{prefill.tokens_per_s:.0f} tok/s x {prefill.gflop_per_token:.2f} GFLOP/token = "
        f"{prefill.tflops:.2f} TFLOP/s ({prefill.of_gemm:.2f} of the GEMM throughput)",
        flush=True,
    )
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine,
        "dtype": str(dtype).removeprefix("torch."),
        # Whether the forward ran the compiled RMSNorm/RoPE/SiLU kernels, as served.
        "row_kernels": any(getattr(m, "kernel", False) for m in model.modules()),
        "limits": asdict(limits),
        "decode": asdict(decode),
        # With --decode-copy: the same decode on oneDNN's packed weights alone.
        "decode_packed": None if packed is None else asdict(packed),
        "prefill": asdict(prefill),
    }


def print_decode(label: str, decode: Decode) -> None:
    print(
        f"{label}: {decode.weight_gb:.3f} GB of weights; forward {decode.forward_ms:.1f} ms "
        f"= {decode.forward_gb_s:.1f} GB/s ({decode.forward_of_copy:.2f} of copy); step "
        f"{decode.step_ms:.1f} ms = {decode.step_gb_s:.1f} GB/s ({decode.step_of_copy:.2f})",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
