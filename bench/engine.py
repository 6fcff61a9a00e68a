"""In-process engine benchmark: decode throughput vs a bare forward, and cached-prefix TTFT.

``python -m bench.engine`` measures, side by side in one run:

* for each temperature (1.0, the OpenAI default, and 0, greedy) and concurrency C: the
  engine's output tokens/s while C requests decode (schedule + ForwardBatch + forward +
  sampling + stop checks, i.e. whole ``step()`` calls), beside the bound: the same
  model's bare batched decode forward (all layers and the LM head) of C tokens at the
  same context length, with no scheduling or sampling. Goal: ratio >= 0.85 at C >= 32.
* TTFT of a request whose 1,000-token prefix is in the radix cache vs the same shape
  cold. Goal: cached / cold <= 0.2.
* overlap scheduling: whole runs of the same C requests with the synchronous scheduler
  and with ``overlap_schedule`` (the next decode step launched on a forward worker
  before the previous one is committed), alternating which runs first; median ratio.

Writes ``bench/results/engine.json`` and ``bench/results/engine.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.machine import describe, machine_info
from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import Scheduler, SchedulerConfig
from services.scheduler.core.stop_checker import StopChecker
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention import ATTENTION_BACKENDS
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.dtype import AUTO, DTYPES, choose_dtype
from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.model_executor.row_kernels import use_row_kernels
from services.scheduler.transport.engine_build import load_kernels
from services.scheduler.transport.heap import keep_heap

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class BenchArgs:
    model: str
    device: str
    dtype: str
    concurrency: list[int]
    prompt_len: int
    output_len: int
    prefix_len: int
    repeats: int
    num_threads: int
    temperatures: list[float]
    attention_backend: str = "torch"
    heap_tuning: bool = True  # transport/heap.py, on in the server by default
    decode_copy: bool | None = None  # the scheduler's --decode-copy (None: its auto)


@dataclass(slots=True)
class ThroughputRow:
    temperature: float  # 0: greedy; otherwise sampled (the sampler is part of every step)
    concurrency: int
    engine_tok_s: float  # decode steps only: C tokens per whole step()
    bound_tok_s: float  # bare model.forward of the same C decode tokens, paired per step
    ratio: float
    end_to_end_tok_s: float  # every output token over the whole run, prefill included


def parse_args() -> BenchArgs:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__)
    p.add_argument("--model", default="models/tokenline-tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        choices=[AUTO, *DTYPES],
        default=AUTO,
        help="auto: as the scheduler chooses for the checkpoint on this hardware",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=2, help="runs per concurrency, summed")
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[1.0, 0.0],
        help="1.0 is the OpenAI default (sampled); 0 is greedy",
    )
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="torch")
    p.add_argument("--heap-tuning", action=argparse.BooleanOptionalAction, default=True)
    return BenchArgs(**vars(p.parse_args()))


def build(args: BenchArgs, overlap: bool = False) -> Scheduler:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = torch.device(args.device)
    if args.heap_tuning and device.type == "cpu":
        keep_heap()  # as the scheduler's engine process does by default
    choice = choose_dtype(args.dtype, ModelConfig.from_dir(args.model).dtype, device)
    print(f"dtype {choice.name} ({choice.reason})", flush=True)
    kernels = load_kernels(args.model, device)
    model, config = load_model(
        args.model,
        choice.dtype,
        device,
        args.attention_backend,
        decode_kernel=kernels.decode_attention,
        decode_copy=args.decode_copy,
    )
    if kernels.row_kernels:
        use_row_kernels(model)  # as the engine does (transport/engine_build.py)
    print(f"row kernels: {'compiled' if kernels.row_kernels else 'eager'}", flush=True)
    max_c = max(args.concurrency)
    # Requests, scratch for the paired bare forwards, and the TTFT prefixes.
    num_tokens = 2 * max_c * (args.prompt_len + args.output_len) + 4 * (args.prefix_len + 64)
    pool = KVPool(
        num_tokens, config.num_layers, config.num_kv_heads, config.head_dim, choice.dtype, device
    )
    stop_checker = StopChecker(
        load_tokenizer(args.model), set(config.eos_token_ids), config.max_context_len
    )
    sched_config = SchedulerConfig(
        max_running_requests=max_c, max_num_batched_tokens=1024, overlap_schedule=overlap
    )
    scheduler = Scheduler.create(
        model, pool, stop_checker, sched_config, args.device, sample_kernel=kernels.sample
    )
    print(f"sampler: {'compiled kernel' if scheduler.sampler.kernel else 'eager'}", flush=True)
    attention_kernel = getattr(scheduler.runner.model.attn_backend, "decode_kernel", False)
    print(f"decode attention: {'compiled kernel' if attention_kernel else 'SDPA'}", flush=True)
    return scheduler


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_prompt(rng: random.Random, length: int) -> list[int]:
    """BOS then ordinary ids (the default model's vocabulary has 129,280)."""
    return [0, *(rng.randrange(1000, 30_000) for _ in range(length - 1))]


def greedy_req(rid: str, input_ids: list[int], max_new_tokens: int) -> Req:
    return bench_req(rid, input_ids, max_new_tokens, temperature=0.0)


def bench_req(rid: str, input_ids: list[int], max_new_tokens: int, temperature: float) -> Req:
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, ignore_eos=True)
    return Req(rid=rid, input_ids=input_ids, params=params)


# ---- throughput -------------------------------------------------------------------------


@dataclass(slots=True)
class DecodeTimes:
    engine_s: float = 0.0  # whole step() calls while all C requests decode
    bound_s: float = 0.0  # bare forwards of the same shapes, each right after its step
    tokens: int = 0
    end_to_end_tok_s: float = 0.0


def engine_decode(
    scheduler: Scheduler, args: BenchArgs, c: int, seed: int, temperature: float = 0.0
) -> DecodeTimes:
    """Run C requests submitted together; pair every all-decode step with a bare forward
    of the same batch (same sizes and context lengths), so both see the same machine load."""
    rng = random.Random(seed)
    for i in range(c):
        prompt = random_prompt(rng, args.prompt_len)
        scheduler.add_request(bench_req(f"t{i}", prompt, args.output_len, temperature))
    scratch = scheduler.kv_pool.allocate(c * (args.prompt_len + args.output_len))
    times, total_tokens = DecodeTimes(), 0
    start = time.perf_counter()
    while scheduler.has_work:
        running = scheduler.running
        is_decode = len(running) == c and all(r.num_uncomputed == 1 for r in running)
        seq_lens = [r.num_computed + 1 for r in running]
        t0 = time.perf_counter()
        rows = scheduler.step()
        elapsed = time.perf_counter() - t0
        produced = sum(len(r.new_token_ids) for r in rows)
        total_tokens += produced
        if is_decode:
            times.engine_s += elapsed
            times.tokens += produced
            times.bound_s += bare_forward(scheduler, seq_lens, scratch, args.device)
    times.end_to_end_tok_s = total_tokens / (time.perf_counter() - start)
    scheduler.kv_pool.free(scratch)
    scheduler.flush_cache()
    return times


def split_slots(slots: list[int], lengths: list[int]) -> list[list[int]]:
    """``slots`` cut into consecutive runs of the given lengths, one per sequence."""
    runs, start = [], 0
    for n in lengths:
        runs.append(slots[start : start + n])
        start += n
    return runs


def bare_forward(
    scheduler: Scheduler, seq_lens: list[int], scratch: list[int], device: str
) -> float:
    """Seconds for model.forward alone on one decode token per sequence (no scheduling,
    no sampling); K/V go to scratch slots."""
    slots = split_slots(scratch, seq_lens)
    batch = ForwardBatch.build(
        [[1000 + i] for i in range(len(seq_lens))], [n - 1 for n in seq_lens], slots, device
    )
    model = scheduler.runner.model
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():  # as ModelRunner runs it: logits in the model's dtype
        hidden = model.hidden_states(batch, model.attn_backend.plan(batch), scheduler.kv_pool)
        model.compute_logits(hidden)
    sync(device)
    return time.perf_counter() - t0


def measure_throughput(scheduler: Scheduler, args: BenchArgs) -> list[ThroughputRow]:
    engine_decode(scheduler, args, 2, seed=-1)  # warm-up
    rows = []
    for temperature, c in itertools.product(args.temperatures, args.concurrency):
        total = DecodeTimes()
        for r in range(args.repeats):
            run = engine_decode(scheduler, args, c, seed=c * 100 + r, temperature=temperature)
            total.engine_s += run.engine_s
            total.bound_s += run.bound_s
            total.tokens += run.tokens
            total.end_to_end_tok_s = max(total.end_to_end_tok_s, run.end_to_end_tok_s)
        engine, bound = total.tokens / total.engine_s, total.tokens / total.bound_s
        row = ThroughputRow(temperature, c, engine, bound, engine / bound, total.end_to_end_tok_s)
        print(
            f"T={temperature:<4} C={c:4d}  engine {row.engine_tok_s:9.1f} tok/s  "
            f"bound {row.bound_tok_s:9.1f} tok/s  ratio {row.ratio:5.2f}  "
            f"(end-to-end {row.end_to_end_tok_s:8.1f} tok/s)",
            flush=True,
        )
        rows.append(row)
    return rows


# ---- overlap scheduling ---------------------------------------------------------------


@dataclass(slots=True)
class OverlapRow:
    temperature: float
    concurrency: int
    sync_tok_s: float  # whole runs (prefill and decode), the synchronous scheduler
    overlap_tok_s: float  # the same runs with ``overlap_schedule``
    ratio: float  # overlap / sync
    round_ratios: list[float]


def run_to_end(scheduler: Scheduler, reqs: list[Req]) -> tuple[int, float]:
    """Submit ``reqs`` together and step until the engine is idle: the output tokens it
    made and the seconds it took, submission included."""
    start = time.perf_counter()
    for req in reqs:
        scheduler.add_request(req)
    produced = 0
    while scheduler.has_work:
        produced += sum(len(row.new_token_ids) for row in scheduler.step())
    return produced, time.perf_counter() - start


def run_tok_s(scheduler: Scheduler, args: BenchArgs, c: int, seed: int, temp: float) -> float:
    """Output tokens/s of C requests submitted together and stepped to the end."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, args.prompt_len) for _ in range(c)]
    reqs = [bench_req(f"o{seed}-{i}", p, args.output_len, temp) for i, p in enumerate(prompts)]
    produced, elapsed = run_to_end(scheduler, reqs)
    scheduler.flush_cache()
    return produced / elapsed


def measure_overlap(sync: Scheduler, args: BenchArgs, rounds: int = 3) -> list[OverlapRow]:
    """The same runs with and without overlap scheduling, alternating which goes first."""
    overlap = build(args, overlap=True)
    run_tok_s(overlap, args, 2, seed=-1, temp=1.0)  # warm-up
    rows = []
    for temperature, c in itertools.product(args.temperatures, args.concurrency):
        pairs = []
        for r in range(rounds):
            order = (sync, overlap) if r % 2 == 0 else (overlap, sync)
            got = {id(s): run_tok_s(s, args, c, c * 100 + r, temperature) for s in order}
            pairs.append((got[id(sync)], got[id(overlap)]))
        sync_tok_s = statistics.median(p[0] for p in pairs)
        overlap_tok_s = statistics.median(p[1] for p in pairs)
        ratios = [round(o / s, 3) for s, o in pairs]
        row = OverlapRow(
            temperature, c, sync_tok_s, overlap_tok_s, statistics.median(ratios), ratios
        )
        print(
            f"overlap T={temperature:<4} C={c:4d}  sync {sync_tok_s:9.1f} tok/s  overlap "
            f"{overlap_tok_s:9.1f} tok/s  ratio {row.ratio:5.2f} (rounds {ratios})",
            flush=True,
        )
        rows.append(row)
    return rows


# ---- TTFT -------------------------------------------------------------------------------


def time_to_first_token(scheduler: Scheduler, req: Req) -> float:
    t0 = time.perf_counter()
    scheduler.add_request(req)
    while not req.output_ids:
        scheduler.step()
    elapsed = time.perf_counter() - t0
    while scheduler.has_work:
        scheduler.step()
    return elapsed


def measure_ttft(scheduler: Scheduler, args: BenchArgs, trials: int = 5) -> dict[str, float]:
    rng = random.Random(7)
    cold, cached, num_cached = [], [], []
    for t in range(trials + 1):  # the first trial warms up and is dropped
        scheduler.flush_cache()
        prefix = random_prompt(rng, args.prefix_len)
        first = greedy_req(f"cold{t}", prefix + random_prompt(rng, 17)[1:], 1)
        cold_s = time_to_first_token(scheduler, first)
        second = greedy_req(f"warm{t}", prefix + random_prompt(rng, 17)[1:], 1)
        cached_s = time_to_first_token(scheduler, second)
        if t:
            cold.append(cold_s)
            cached.append(cached_s)
            num_cached.append(second.num_cached_tokens)
    result = {
        "prompt_tokens": args.prefix_len + 16,
        "cached_tokens": statistics.median(num_cached),
        "cold_ttft_ms": statistics.median(cold) * 1e3,
        "cached_ttft_ms": statistics.median(cached) * 1e3,
    }
    result["ratio"] = result["cached_ttft_ms"] / result["cold_ttft_ms"]
    print(
        f"TTFT {result['prompt_tokens']} tokens: cold {result['cold_ttft_ms']:.1f} ms, "
        f"{result['cached_tokens']:.0f} cached {result['cached_ttft_ms']:.1f} ms, "
        f"ratio {result['ratio']:.3f}",
        flush=True,
    )
    return result


# ---- output -----------------------------------------------------------------------------


def plot(rows: list[ThroughputRow], ttft: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    concurrencies = sorted({r.concurrency for r in rows})
    temperatures = sorted({r.temperature for r in rows}, reverse=True)
    width = 0.8 / (1 + len(temperatures))
    by_key = {(r.temperature, r.concurrency): r for r in rows}
    xs = range(len(concurrencies))
    bound = [by_key[(temperatures[0], c)].bound_tok_s for c in concurrencies]
    ax1.bar([x - 0.4 + width / 2 for x in xs], bound, width, label="bare forward")
    for i, temp in enumerate(temperatures, start=1):
        offsets = [x - 0.4 + width * (i + 0.5) for x in xs]
        mine = [by_key[(temp, c)] for c in concurrencies]
        label = "engine, greedy" if temp == 0 else f"engine, T={temp}"
        ax1.bar(offsets, [r.engine_tok_s for r in mine], width, label=label)
        for x, r in zip(offsets, mine, strict=True):
            ax1.text(x, r.engine_tok_s, f"{r.ratio:.0%}", ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(list(xs), [str(c) for c in concurrencies])
    ax1.set_xlabel("concurrent requests")
    ax1.set_ylabel("output tokens/s (decode)")
    ax1.set_yscale("log")
    ax1.legend()
    ax1.set_title("engine vs bare batched forward")
    ax2.bar(["cold", "cached"], [ttft["cold_ttft_ms"], ttft["cached_ttft_ms"]])
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_title(f"{ttft['prompt_tokens']}-token prompt, ratio {ttft['ratio']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    scheduler = build(args)
    machine = machine_info()
    print(
        f"model {args.model} on {args.device}, {torch.get_num_threads()} threads; prompts "
        f"{args.prompt_len} tokens, {args.output_len} output tokens, temperatures "
        f"{args.temperatures}\nmachine: {describe(machine)}",
        flush=True,
    )
    rows = measure_throughput(scheduler, args)
    ttft = measure_ttft(scheduler, args)
    overlap = measure_overlap(scheduler, args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {
        "args": asdict(args),
        "machine": machine,
        "dtype": str(next(scheduler.runner.model.parameters()).dtype).removeprefix("torch."),
        "throughput": [asdict(r) for r in rows],
        "ttft": ttft,
        "overlap": [asdict(r) for r in overlap],
    }
    (RESULTS / "engine.json").write_text(json.dumps(report, indent=2))
    plot(rows, ttft, RESULTS / "engine.png")
    print(f"wrote {RESULTS / 'engine.json'} and {RESULTS / 'engine.png'}")


if __name__ == "__main__":
    main()
