"""PNG plots: one run's latency distributions over time, and two servers side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.serve.client import RequestResult  # noqa: E402
from bench.serve.metrics import LATENCY_METRICS, latency_samples  # noqa: E402

BINS = 30


def plot_run(results: list[RequestResult], title: str, path: Path) -> None:
    """TTFT, E2E and ITL histograms, and TTFT/E2E against send time (queueing shows as a rise)."""
    samples = {k: [v * 1000 for v in vs] for k, vs in latency_samples(results).items()}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    counted = {"ttft": "requests", "e2e": "requests", "itl": "chunk gaps"}
    for ax, (name, ylabel) in zip(axes.flat[:3], counted.items(), strict=True):
        ax.hist(samples[name] or [0.0], bins=BINS, color="tab:blue", alpha=0.8)
        ax.set(title=f"{name.upper()} distribution", xlabel="ms", ylabel=ylabel)
    ax = axes.flat[3]
    done = [r for r in results if r.success]
    ax.scatter([r.start_s for r in done], [r.e2e_s * 1000 for r in done], s=10, label="E2E")
    ax.scatter([r.start_s for r in done], [r.ttft_s * 1000 for r in done], s=10, label="TTFT")
    ax.set(title="latency vs send time", xlabel="send time (s)", ylabel="ms")
    ax.legend()
    _save(fig, title, path)


def plot_compare(summaries: dict[str, dict[str, Any]], title: str, path: Path) -> None:
    """Throughputs, and mean/p50/p99 of each latency, per server."""
    names = list(summaries)
    fig, axes = plt.subplots(
        1, 1 + len(LATENCY_METRICS), figsize=(4 * (1 + len(LATENCY_METRICS)), 4.5)
    )
    _bars(
        axes[0],
        names,
        {n: [summaries[n]["request_throughput"], summaries[n]["output_throughput"]] for n in names},
        ["req/s", "out tok/s"],
        "throughput",
    )
    axes[0].set_yscale("log")
    for ax, metric in zip(axes[1:], LATENCY_METRICS, strict=True):
        values = {
            n: [summaries[n][f"{metric}_ms"][k] or 0.0 for k in ("mean", "p50", "p99")]
            for n in names
        }
        _bars(ax, names, values, ["mean", "p50", "p99"], f"{metric.upper()} (ms)")
    _save(fig, title, path)


def plot_sweep(cells: list[dict[str, Any]], title: str, path: Path) -> None:
    """Output tok/s against concurrency: one panel per (dtype setting, temperature); with
    several rounds, the median line over every round's points."""
    panels = sorted({(c["setting"], c["temperature"]) for c in cells}, key=str)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.2), squeeze=False)
    for ax, (setting, temp) in zip(axes[0], panels, strict=True):
        for server in sorted({c["server"] for c in cells}):
            by_conc: dict[int, list[float]] = {}
            for c in cells:
                if (c["setting"], c["temperature"], c["server"]) == (setting, temp, server):
                    by_conc.setdefault(c["concurrency"], []).append(c["output_tok_s"])
            concs = sorted(by_conc)
            medians = [np.median(by_conc[x]) for x in concs]
            (line,) = ax.plot(concs, medians, marker="o", label=server)
            for x in concs:
                ax.scatter([x] * len(by_conc[x]), by_conc[x], s=10, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set(title=f"{setting}, T={temp}", xlabel="concurrency", ylabel="output tok/s")
        ax.legend(fontsize="small")
    _save(fig, title, path)


def _bars(
    ax: Any, names: list[str], values: dict[str, list[float]], groups: list[str], title: str
) -> None:
    x = np.arange(len(groups))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(x + i * width, values[name], width, label=name)
    ax.set_xticks(x + width * (len(names) - 1) / 2, groups)
    ax.set_title(title)
    ax.legend(fontsize="small")


def _save(fig: Any, title: str, path: Path) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
