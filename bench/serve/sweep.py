"""`python -m bench.serve sweep`: tokenline vs a peer over a grid, one run.

The peer (``--peer``) is `transformers serve --continuous-batching` or vLLM's CPU engine
(`bench.serve.vllm_cpu`). For each dtype setting (``defaults``: each server at its own
default dtype, i.e. tokenline's hardware-aware ``auto`` and the peer's ``auto``, which
for both peers is the checkpoint's dtype; or a dtype name: both servers in it), each
server is started once and driven through every temperature x concurrency cell, then
stopped before the other starts (never both at once: they would share the cores). Each
cell has prompts of its own, the same for both servers: cells that shared a seed sent
the same prompts again, which tokenline's prefix cache then served without their
prefill (every cell after the first, partly or wholly).
Concurrency C sends ``prompts_per_slot * C`` requests with at most C in flight.
tokenline's requests ask for the stage breakdown, so its ``dispatch`` stage (routing +
AddRequest hop) is reported per cell. Ratios are tokenline / peer.

``--rounds N`` repeats all of it N times, the server that goes first alternating, and
reports each cell's median over rounds with every round's own ratio beside it: on a
shared machine one run of a cell moves by up to a third, the peer's as much as ours.

Writes ``bench/results/serve-sweep.json`` and ``.png``, and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.machine import describe, machine_info
from bench.serve import cli
from bench.serve.client import RequestSettings
from bench.serve.metrics import percentile
from bench.serve.plots import plot_sweep
from bench.serve.report import write_json
from bench.serve.servers import PEERS, PeerServer, ServerStartError, TokenlineServer
from bench.serve.session import benchmark, create_workload
from services.common.tokenizer import load_tokenizer

DEFAULTS = "defaults"


def create_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve sweep", description=__doc__)
    p.add_argument("--model-dir", default=cli.DEFAULT_MODEL_DIR)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--settings",
        nargs="+",
        default=[DEFAULTS, "float32"],
        help="'defaults' (each server's own dtype) and/or a dtype both servers run in",
    )
    p.add_argument(
        "--servers",
        nargs="+",
        choices=["tokenline", *cli.PEER_NAMES],
        default=None,
        help="run only these (default: tokenline and the peer)",
    )
    p.add_argument("--concurrency", type=cli.positive_int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    p.add_argument("--prompts-per-slot", type=cli.positive_int, default=2)
    p.add_argument("--min-prompts", type=cli.positive_int, default=8)
    cli.add_peer_flags(p)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument(
        "--rounds",
        type=cli.positive_int,
        default=1,
        help="repeat the whole sweep, alternating which server goes first; medians reported",
    )
    cli.add_dataset_flags(p)
    p.set_defaults(input_len=128, output_len=64)
    g = p.add_argument_group("load")
    g.add_argument("--warmup", type=int, default=4)
    g.add_argument("--timeout", type=float, default=600.0)
    g.add_argument("--warmup-timeout", type=float, default=120.0)
    cli.add_output_flags(p, default_name="sweep")
    return p


def server_dtype(setting: str) -> str:
    """The --dtype both servers get: 'auto' (each one's own default) or the setting."""
    return "auto" if setting == DEFAULTS else setting


CELL_SEED_STRIDE = 1000  # a cell's prompts have seed + stride * (its index + 1); warm-up +1


def cell_args(
    args: argparse.Namespace, concurrency: int, temperature: float, index: int
) -> argparse.Namespace:
    """The cell's run arguments; ``index`` (its place in the grid) picks its prompts."""
    num_prompts = max(args.min_prompts, args.prompts_per_slot * concurrency)
    return argparse.Namespace(
        **vars(args)
        | dict(
            num_prompts=num_prompts,
            max_concurrency=concurrency,
            temperature=temperature,
            request_rate=float("inf"),
            seed=args.seed + CELL_SEED_STRIDE * (index + 1),
        )
    )


def run_server_cells(
    server_cls: type, setting: str, args: argparse.Namespace, device: str, log_dir: Path
) -> list[dict[str, Any]]:
    """Start one server, run every temperature x concurrency cell against it, stop it."""
    dtype = server_dtype(setting)
    extra = args.tokenline_args if server_cls is TokenlineServer else args.peer_args
    tokenizer = load_tokenizer(args.model_dir)
    cells = []
    with server_cls(args.model_dir, dtype, device, extra, log_dir, args.start_timeout) as server:
        base = RequestSettings(
            base_url=server.base_url,
            model=server.model,
            ignore_eos=False,  # transformers serve rejects unknown fields; same for every peer
            debug_stages=server_cls is TokenlineServer,
            timeout_s=args.timeout,
        )
        grid = [(t, c) for t in args.temperatures for c in args.concurrency]
        for index, (temperature, concurrency) in enumerate(grid):
            one = cell_args(args, concurrency, temperature, index)
            settings = replace(base, temperature=temperature)
            run = benchmark(server.label, settings, create_workload(one, tokenizer), one)
            cells.append(cell_row(server.label, setting, dtype, one, run.report, run.results))
            print(cell_line(cells[-1]), flush=True)
    return cells


def cell_row(
    label: str, setting: str, dtype: str, args: argparse.Namespace, report: dict, results: list
) -> dict[str, Any]:
    summary = report["summary"]
    dispatch = [r.stages_ms.get("dispatch") for r in results]
    # The first C requests arrive together; later ones each as a slot frees (steady state).
    steady = [d for d in dispatch[args.max_concurrency :] if d is not None]
    dispatch = [d for d in dispatch if d is not None]
    return {
        "server": label,
        "setting": setting,
        "dtype": dtype,
        "temperature": args.temperature,
        "concurrency": args.max_concurrency,
        "num_prompts": args.num_prompts,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "output_tokens": summary["total_output_tokens"],
        "output_tok_s": summary["output_throughput"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p90_ms": summary["ttft_ms"]["p90"],
        "tpot_p50_ms": summary["tpot_ms"]["p50"],
        "dispatch_p50_ms": percentile(dispatch, 50) if dispatch else None,
        "steady_dispatch_p50_ms": percentile(steady, 50) if steady else None,
        "errors": summary["errors"],
    }


def cell_line(c: dict[str, Any]) -> str:
    dispatch, steady = c["dispatch_p50_ms"], c["steady_dispatch_p50_ms"]
    extra = f" dispatch p50 {dispatch:.2f} ms" if dispatch is not None else ""
    extra += f" (steady {steady:.2f} ms)" if steady is not None else ""
    return (
        f"{c['server']:<12} {c['setting']:<9} T={c['temperature']:<4} C={c['concurrency']:<3} "
        f"{c['output_tok_s']:8.1f} tok/s  TTFT p50 {c['ttft_p50_ms'] or 0:8.1f} ms "
        f"p90 {c['ttft_p90_ms'] or 0:8.1f} ms "
        f"({c['completed']} ok, {c['failed']} failed){extra}"
    )


def ratio_rows(cells: list[dict[str, Any]], peer: str = "transformers") -> list[dict[str, Any]]:
    """tokenline / ``peer`` for each (setting, temperature, concurrency): the ratio of
    each round's pair (a cell without ``round`` is round 0), and medians over rounds."""
    by_key: dict[tuple, dict[int, dict[str, Any]]] = {}
    for c in cells:
        key = (c["server"], c["setting"], c["temperature"], c["concurrency"])
        by_key.setdefault(key, {})[c.get("round", 0)] = c
    rows = []
    for (server, setting, temp, conc), ours in by_key.items():
        theirs = by_key.get((peer, setting, temp, conc), {})
        rounds = sorted(set(ours) & set(theirs))
        if server != "tokenline" or not rounds:
            continue
        pairs = [(ours[r], theirs[r]) for r in rounds]
        round_ratios = [_ratio(a["output_tok_s"], b["output_tok_s"]) for a, b in pairs]
        rows.append(
            {
                "peer": peer,
                "setting": setting,
                "temperature": temp,
                "concurrency": conc,
                "rounds": len(rounds),
                "tokenline_tok_s": _median([a["output_tok_s"] for a, _ in pairs]),
                "peer_tok_s": _median([b["output_tok_s"] for _, b in pairs]),
                "throughput_ratio": _median(round_ratios),
                "round_throughput_ratios": round_ratios,
                "ttft_p50_ratio": _median(
                    [_ratio(a["ttft_p50_ms"], b["ttft_p50_ms"]) for a, b in pairs]
                ),
                # Cells written before p90 was recorded have none: no ratio.
                "ttft_p90_ratio": _median(
                    [_ratio(a.get("ttft_p90_ms"), b.get("ttft_p90_ms")) for a, b in pairs]
                ),
                "tokenline_dispatch_p50_ms": _median([a["dispatch_p50_ms"] for a, _ in pairs]),
                "tokenline_steady_dispatch_p50_ms": _median(
                    [a["steady_dispatch_p50_ms"] for a, _ in pairs]
                ),
            }
        )
    return rows


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table_lines(rows: list[dict[str, Any]], peer: str = "transformers") -> list[str]:
    head = f"{'setting':<10}{'T':>5}{'C':>5}{'tokenline':>11}{peer:>14}"
    lines = [
        head
        + f"{'tok/s ×':>9}{'TTFT p50 ×':>12}{'p90 ×':>7}{'dispatch p50 all/steady':>26}"
        + "  rounds (tok/s ×)"
    ]
    for r in rows:
        d, steady = r["tokenline_dispatch_p50_ms"], r["tokenline_steady_dispatch_p50_ms"]
        each = ", ".join("-" if x is None else f"{x:.2f}" for x in r["round_throughput_ratios"])
        lines.append(
            f"{r['setting']:<10}{r['temperature']:>5}{r['concurrency']:>5}"
            f"{r['tokenline_tok_s']:>11.1f}{r['peer_tok_s']:>14.1f}"
            f"{_fmt(r['throughput_ratio'], 9)}{_fmt(r['ttft_p50_ratio'], 12)}"
            f"{_fmt(r['ttft_p90_ratio'], 7)}"
            f"{_ms(d):>14}{_ms(steady):>12}  {each}"
        )
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def _fmt(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"


def main(argv: list[str]) -> int:
    args = create_parser().parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    json_path, png_path = cli.output_paths(args, "sweep")
    log_dir = json_path.parent / f"{json_path.stem}-logs"
    machine = machine_info()
    print(f"machine: {describe(machine)}", flush=True)
    cells: list[dict[str, Any]] = []
    servers: tuple[type[TokenlineServer] | type[PeerServer], ...] = (
        TokenlineServer,
        PEERS[args.peer],
    )
    wanted = args.servers or [s.label for s in servers]
    try:
        for round_index in range(args.rounds):
            order = servers if round_index % 2 == 0 else servers[::-1]
            for setting in args.settings:
                for server_cls in order:
                    if server_cls.label in wanted:
                        run = run_server_cells(server_cls, setting, args, device, log_dir)
                        cells += [c | {"round": round_index} for c in run]
    except ServerStartError as exc:
        print(f"sweep failed: {exc}", file=sys.stderr)
        return 2
    rows = ratio_rows(cells, args.peer)
    report = {
        "name": args.name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "model_dir": args.model_dir,
        "device": device,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "peer": args.peer,
        "ratio": f"tokenline / {args.peer}, median over rounds",
        "ratios": rows,
        "cells": cells,
    }
    write_json(report, json_path)
    plot_sweep(cells, f"{args.model_dir} on {describe(machine)}", png_path)
    print(f"machine: {describe(machine)}")
    print("\n".join(table_lines(rows, args.peer)))
    print(f"wrote {json_path} and {png_path} (server logs in {log_dir})")
    return 0 if all(c["failed"] == 0 for c in cells) else 1
