"""Tokenization benchmark: `python -m bench.tokenize`.

Closed-loop clients on one event loop, as in the frontend: each client encodes a
prompt, then the next, for a fixed time. Three ways to serve them, side by side
in interleaved rounds on the same prompts (median of the rounds is reported):

- ``inline``: one ``tokenizer.encode`` per request on the event loop (what the
  frontend did before the dynamic batch tokenizer);
- ``thread``: one encode per request on the default thread pool;
- ``batched``: the frontend's DynamicBatchTokenizer (window 2 ms, <= 64 per call).

Reports requests/s per concurrency, the headline ratio batched / inline (and
batched / thread) at concurrency 64, per-request latency, and the event loop's
p99 lag (a 1 ms ticker's lateness: how long other RPCs would wait meanwhile).
Every mode's ids are checked against ``tokenizer.encode`` first.

Writes bench/results/tokenize.json and tokenize.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from services.common.default_model import ensure_default_model
from services.common.tokenizer import load_tokenizer
from services.frontend.dispatch.batch_tokenizer import DynamicBatchTokenizer

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "tokenline-tiny"
MODES = ("inline", "thread", "batched")
CORPUS = (
    "The frontend turns protocol requests into token ids before anything reaches a GPU. "
    "Users send chat messages, code and documents in many languages. "
    "你好，世界！今天我们讨论分布式系统的设计与实现。日本語のテキストも混ざります。"
    "def handler(request):\n    return [x * 2 for x in request.items if x]\n"
    "Les systèmes de service de modèles de langage doivent gérer des milliers de requêtes. "
)

Encode = Callable[[str], Awaitable[list[int]]]


def make_prompts(tokenizer: PreTrainedTokenizerBase, count: int, seed: int = 0) -> list[str]:
    """Chat-rendered prompts of 20 to ~1,500 tokens, deterministic per seed."""
    rng = random.Random(seed)
    text = CORPUS * 40
    prompts = []
    for _ in range(count):
        start = rng.randrange(len(CORPUS))
        length = int(rng.lognormvariate(5.5, 1.0)) + 40
        content = text[start : start + min(length, len(text) - start)]
        messages = [{"role": "user", "content": content}]
        prompts.append(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
    return prompts


def encoders(
    tokenizer: PreTrainedTokenizerBase, window_ms: float, max_batch: int
) -> dict[str, Callable[[], tuple[Encode, Callable[[], Awaitable[dict[str, Any]]]]]]:
    """Per mode: a factory of (encode, close) built inside the running loop."""

    def inline() -> tuple[Encode, Callable[[], Awaitable[dict[str, Any]]]]:
        async def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        return encode, _no_stats

    def thread() -> tuple[Encode, Callable[[], Awaitable[dict[str, Any]]]]:
        async def encode(text: str) -> list[int]:
            return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)

        return encode, _no_stats

    def batched() -> tuple[Encode, Callable[[], Awaitable[dict[str, Any]]]]:
        batcher = DynamicBatchTokenizer(tokenizer, window_ms / 1000.0, max_batch)

        async def encode(text: str) -> list[int]:
            return await batcher.encode(text, add_special_tokens=False)

        async def close() -> dict[str, Any]:
            await batcher.close()
            calls = max(batcher.num_calls, 1)
            return {
                "tokenizer_calls": batcher.num_calls,
                "mean_batch": batcher.num_requests / calls,
            }

        return encode, close

    return {"inline": inline, "thread": thread, "batched": batched}


async def _no_stats() -> dict[str, Any]:
    return {}


async def _ticker(lags: list[float], stop: asyncio.Event) -> None:
    """Lateness of a 1 ms sleep: how long the loop was unavailable to anything else."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        start = loop.time()
        await asyncio.sleep(0.001)
        lags.append(loop.time() - start - 0.001)


async def run_closed_loop(
    encode: Encode, prompts: list[str], concurrency: int, duration: float
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    lags: list[float] = []
    stop = asyncio.Event()
    deadline = loop.time() + duration

    async def client(offset: int) -> None:
        i = offset
        while loop.time() < deadline:
            start = loop.time()
            await encode(prompts[i % len(prompts)])
            latencies.append(loop.time() - start)
            i += concurrency
            await asyncio.sleep(0)  # the RPC boundary: a handler returns to the loop here

    ticker = asyncio.create_task(_ticker(lags, stop))
    began = loop.time()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    elapsed = loop.time() - began
    stop.set()
    await ticker
    latencies.sort()
    lags.sort()
    return {
        "requests_per_s": len(latencies) / elapsed,
        "latency_p50_ms": 1000 * latencies[len(latencies) // 2],
        "latency_p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
        "loop_lag_p99_ms": 1000 * lags[int(len(lags) * 0.99)] if lags else 0.0,
        "num_requests": len(latencies),
    }


async def check_ids(make: Callable, prompts: list[str], expected: list[list[int]]) -> None:
    encode, close = make()
    got = await asyncio.gather(*(encode(p) for p in prompts))
    await close()
    if list(got) != expected:
        raise SystemExit("a mode returned ids that differ from tokenizer.encode")


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer(
        ensure_default_model(DEFAULT_MODEL) if args.model is None else args.model
    )
    prompts = make_prompts(tokenizer, args.num_prompts)
    factories = encoders(tokenizer, args.window_ms, args.max_batch)
    expected = [tokenizer.encode(p, add_special_tokens=False) for p in prompts[:128]]
    for make in factories.values():
        await check_ids(make, prompts[:128], expected)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {m: {} for m in MODES}
    for concurrency in args.concurrency:
        for _ in range(args.rounds):
            for mode in MODES:  # interleaved, so a noisy neighbour hits every mode alike
                encode, close = factories[mode]()
                result = await run_closed_loop(encode, prompts, concurrency, args.duration)
                result |= await close()
                runs[mode].setdefault(concurrency, []).append(result)
    return summarize(runs, tokenizer, prompts, args)


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    keys = results[0].keys()
    return {k: statistics.median(r[k] for r in results) for k in keys}


def summarize(
    runs: dict[str, dict[int, list[dict[str, Any]]]],
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    table = {m: {str(c): _median(rs) for c, rs in by_c.items()} for m, by_c in runs.items()}
    head = str(args.headline_concurrency)
    rps = {m: table[m][head]["requests_per_s"] for m in MODES} if head in table["batched"] else {}
    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {
            "window_ms": args.window_ms,
            "max_batch": args.max_batch,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "prompt_tokens_median": statistics.median(lengths),
            "prompt_tokens_max": max(lengths),
        },
        "headline_concurrency": args.headline_concurrency,
        "ratio_batched_over_inline": rps["batched"] / rps["inline"] if rps else None,
        "ratio_batched_over_thread": rps["batched"] / rps["thread"] if rps else None,
        "by_mode": table,
    }


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rps, ax_lag) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        points = sorted((int(c), r) for c, r in summary["by_mode"][mode].items())
        xs = [c for c, _ in points]
        ax_rps.plot(xs, [r["requests_per_s"] for _, r in points], marker="o", label=mode)
        ax_lag.plot(xs, [r["loop_lag_p99_ms"] for _, r in points], marker="o", label=mode)
    for ax, title in ((ax_rps, "tokenization requests/s"), (ax_lag, "event-loop lag p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    ratio = summary["ratio_batched_over_inline"]
    if ratio is not None:
        fig.suptitle(
            f"dynamic batch / one encode per request at {summary['headline_concurrency']}: "
            f"{ratio:.2f}x"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(summary: dict[str, Any]) -> None:
    print(f"{'mode':8} {'conc':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'lag p99':>8}")
    for mode in MODES:
        for c, r in sorted(summary["by_mode"][mode].items(), key=lambda kv: int(kv[0])):
            print(
                f"{mode:8} {c:>5} {r['requests_per_s']:9.0f} {r['latency_p50_ms']:8.2f} "
                f"{r['latency_p99_ms']:8.2f} {r['loop_lag_p99_ms']:8.2f}"
                + (f"  mean batch {r['mean_batch']:.1f}" if "mean_batch" in r else "")
            )
    c = summary["headline_concurrency"]
    if summary["ratio_batched_over_inline"] is not None:
        print(
            f"at concurrency {c}: batched / inline = {summary['ratio_batched_over_inline']:.2f}x, "
            f"batched / thread = {summary['ratio_batched_over_thread']:.2f}x"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--headline-concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=2.0, help="seconds per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--window-ms", type=float, default=2.0)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    started = time.time()
    summary = asyncio.run(measure(args))
    summary["wall_s"] = time.time() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenize.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.out / "tokenize.png")
    report(summary)
    print(f"wrote {args.out / 'tokenize.json'} and tokenize.png")


if __name__ == "__main__":
    main()
