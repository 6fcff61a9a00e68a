"""What the REST/SSE gateway adds on top of calling the frontend over gRPC directly.

One real stack (services.launch.LocalStack); each round sends the same completion
request both ways, alternating, so machine load hits both sides alike:

    unary   max_tokens=1, non-streamed: per-request latency (JSON vs gRPC unary)
    stream  max_tokens=64, streamed: time to the last frame, and frames per second

    python -m bench.gateway_overhead [--rounds 40] [--model models/tokenline-tiny]

Writes bench/results/gateway_overhead.json and .png; prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
from tokenline.v1 import frontend_pb2_grpc, openai_pb2

from services.launch import LocalStack, StackPorts

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "The quick brown fox"
STREAM_TOKENS = 64


def _proto(max_tokens: int, stream: bool) -> openai_pb2.CompletionRequest:
    sampling = openai_pb2.OpenAISampling(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return openai_pb2.CompletionRequest(prompts=[PROMPT], sampling=sampling, stream=stream)


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": stream,
    }  # fmt: skip


def _timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    frames = fn()
    return time.perf_counter() - start, frames


def _http_stream(http: httpx.Client, url: str) -> int:
    with http.stream("POST", url, json=_body(STREAM_TOKENS, True)) as resp:
        frames = sum(1 for line in resp.iter_lines() if line.startswith("data: "))
    return frames - 1  # [DONE]


def measure(stack: LocalStack, rounds: int) -> dict[str, dict[str, list[float]]]:
    url = f"{stack.base_url}/completions"
    samples: dict[str, dict[str, list[float]]] = {
        k: {"grpc": [], "gateway": []} for k in ("unary_s", "stream_s", "stream_frames")
    }
    with grpc.insecure_channel(stack.addr("frontend")) as channel, httpx.Client(timeout=60) as http:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        ways: dict[str, tuple[Callable[[], int], Callable[[], int]]] = {
            "grpc": (
                lambda: bool(stub.Completion(_proto(1, False), timeout=60)),
                lambda: sum(
                    1 for _ in stub.CompletionStream(_proto(STREAM_TOKENS, True), timeout=60)
                ),
            ),
            "gateway": (
                lambda: bool(http.post(url, json=_body(1, False)).raise_for_status()),
                lambda: _http_stream(http, url),
            ),
        }
        for way in ways.values():  # warm-up: JIT paths, connections, prefix cache
            way[0](), way[1]()
        for _ in range(rounds):
            for name, (unary, stream) in ways.items():
                samples["unary_s"][name].append(_timed(unary)[0])
                seconds, frames = _timed(stream)
                samples["stream_s"][name].append(seconds)
                samples["stream_frames"][name].append(frames)
    return samples


def summarize(samples: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    p50 = {k: {w: statistics.median(v) for w, v in ways.items()} for k, ways in samples.items()}
    return {
        "p50": p50,
        "unary_added_ms": 1000 * (p50["unary_s"]["gateway"] - p50["unary_s"]["grpc"]),
        "unary_ratio": p50["unary_s"]["gateway"] / p50["unary_s"]["grpc"],
        "stream_added_ms": 1000 * (p50["stream_s"]["gateway"] - p50["stream_s"]["grpc"]),
        "stream_ratio": p50["stream_s"]["gateway"] / p50["stream_s"]["grpc"],
    }


def plot(summary: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    titles = {"unary_s": "unary, 1 token", "stream_s": f"stream, {STREAM_TOKENS} tokens"}
    for ax, (key, title) in zip(axes, titles.items(), strict=True):
        values = summary["p50"][key]
        ax.bar(list(values), [1000 * v for v in values.values()], color=["#777", "#3a7"])
        ax.set_title(title)
        ax.set_ylabel("p50 latency (ms)")
    fig.suptitle("gateway (HTTP JSON / SSE) vs direct gRPC to the frontend")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tokenline-tiny")
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    stack = LocalStack(
        args.model, StackPorts.free(), scheduler_args=["--num-threads", "1"], log_dir=logs
    )
    stack.start()
    try:
        samples = measure(stack, args.rounds)
    finally:
        stack.stop()
    summary = summarize(samples) | {"rounds": args.rounds, "stream_tokens": STREAM_TOKENS}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_overhead.json").write_text(
        json.dumps(summary | {"samples": samples}, indent=1)
    )
    plot(summary, RESULTS / "gateway_overhead.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "p50"}, indent=1))
    print(json.dumps(summary["p50"], indent=1))


if __name__ == "__main__":
    main()
