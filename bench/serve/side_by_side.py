"""`python -m bench.serve compare`: tokenline and a peer on one model directory.

The peer (``--peer``) is `transformers serve --continuous-batching` or vLLM's CPU engine
(`bench.serve.vllm_cpu`). Both servers get the same dtype and device, the same prompts,
the same arrival schedule and the same request bodies; they run one after the other
(never at the same time, so neither steals the other's cores), each stopped before the
next starts. Ratios are tokenline / peer: above 1 is better for throughput, below 1 is
better for latency. The report names the machine (CPU model and flags).

The request bodies carry no `ignore_eos`: `transformers serve` rejects unknown
fields (HTTP 422). Output lengths can therefore differ where a model samples EOS;
each side's token totals are in the report, and throughputs are per token.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.machine import describe, machine_info
from bench.serve import cli
from bench.serve.client import RequestSettings
from bench.serve.metrics import LATENCY_METRICS
from bench.serve.plots import plot_compare
from bench.serve.report import warmup_lines, write_json
from bench.serve.servers import PEERS, PeerServer, ServerStartError, TokenlineServer
from bench.serve.session import BenchRun, Workload, benchmark, create_workload
from services.common.tokenizer import load_tokenizer

ServerClass = type[TokenlineServer] | type[PeerServer]
THROUGHPUTS = {
    "request_throughput": "request throughput (req/s)",
    "output_throughput": "output throughput (tok/s)",
    "total_token_throughput": "total token throughput (tok/s)",
}
LATENCY_STATS = ("mean", "p50", "p99")


def metric_values(summary: dict[str, Any]) -> dict[str, float | None]:
    """Flat {key: value} of the compared metrics: throughputs, then latency stats in ms."""
    values: dict[str, float | None] = {key: summary[key] for key in THROUGHPUTS}
    for metric in LATENCY_METRICS:
        for stat in LATENCY_STATS:
            values[f"{metric}_{stat}_ms"] = summary[f"{metric}_ms"][stat]
    return values


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """ours / theirs per metric; None where either side has no value or theirs is 0."""
    a, b = metric_values(ours), metric_values(theirs)
    return {k: (a[k] / b[k] if a[k] is not None and b[k] else None) for k in a}


def ratio_lines(
    ours: dict[str, Any], theirs: dict[str, Any], peer: str = "transformers"
) -> list[str]:
    a, b, r = metric_values(ours), metric_values(theirs), ratios(ours, theirs)
    lines = [f"{'metric':<32}{'tokenline':>12}{peer:>14}{'ratio':>9}"]
    for key in a:
        label = THROUGHPUTS.get(key) or key.replace("_", " ").upper().replace(" MS", " (ms)")
        lines.append(f"{label:<32}{_num(a[key], 12)}{_num(b[key], 14)}{_num(r[key], 9, 3)}")
    for label, summary in (("tokenline", ours), (peer, theirs)):
        lines.append(
            f"{label}: {summary['completed']} ok / {summary['failed']} failed, "
            f"{summary['total_output_tokens']} output tokens"
        )
    return lines


def _num(value: float | None, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def run_server(
    server_cls: ServerClass,
    args: argparse.Namespace,
    device: str,
    workload: Workload,
    log_dir: Path,
) -> BenchRun:
    extra = args.tokenline_args if server_cls is TokenlineServer else args.peer_args
    server = server_cls(args.model_dir, args.dtype, device, extra, log_dir, args.start_timeout)
    with server:
        print(f"{server.label}: serving at {server.base_url}; sending {args.num_prompts} requests")
        settings = RequestSettings(
            base_url=server.base_url,
            model=server.model,
            endpoint=args.endpoint,
            ignore_eos=False,
            temperature=args.temperature,
            timeout_s=args.timeout,
        )
        run = benchmark(server.label, settings, workload, args)
    for line in warmup_lines(run.report):
        print(f"{server.label}: {line}")
    return run


def compare_report(
    args: argparse.Namespace, device: str, machine: dict[str, Any], runs: dict[str, BenchRun]
) -> dict:
    summaries = {label: run.report["summary"] for label, run in runs.items()}
    return {
        "name": args.name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "model_dir": args.model_dir,
        "dtype": args.dtype,
        "device": device,
        "peer": args.peer,
        "ratio": f"tokenline / {args.peer}",
        "ratios": ratios(summaries["tokenline"], summaries[args.peer]),
        "servers": {label: run.report for label, run in runs.items()},
    }


def main(argv: list[str]) -> int:
    args = cli.create_compare_parser().parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    json_path, png_path = cli.output_paths(args, "compare")
    workload = create_workload(args, load_tokenizer(args.model_dir))
    log_dir = json_path.parent / f"{json_path.stem}-logs"
    machine = machine_info()
    print(f"machine: {describe(machine)}", flush=True)
    runs: dict[str, BenchRun] = {}
    try:
        for server_cls in (TokenlineServer, PEERS[args.peer]):
            runs[server_cls.label] = run_server(server_cls, args, device, workload, log_dir)
    except ServerStartError as exc:
        print(f"compare failed: {exc}", file=sys.stderr)
        return 2
    report = compare_report(args, device, machine, runs)
    write_json(report, json_path)
    summaries = {label: run.report["summary"] for label, run in runs.items()}
    title = f"{args.model_dir} ({args.dtype}) on {describe(machine)}"
    plot_compare(summaries, title, png_path)
    print(f"machine: {describe(machine)}")
    print("\n".join(ratio_lines(summaries["tokenline"], summaries[args.peer], args.peer)))
    print(f"wrote {json_path} and {png_path} (server logs in {log_dir})")
    return 0 if all(s["failed"] == 0 for s in summaries.values()) else 1
