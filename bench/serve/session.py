"""One benchmark against one base URL: warm-up, the measured run, the report files."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from transformers import PreTrainedTokenizerBase

from bench.serve import cli
from bench.serve.client import RequestResult, RequestSettings
from bench.serve.datasets import BenchPrompt, build_dataset
from bench.serve.plots import plot_run
from bench.serve.report import (
    build_report,
    config_dict,
    summary_lines,
    warmup_lines,
    write_json,
)
from bench.serve.runner import LoadConfig, RunOutcome, fill_token_counts, run_load
from services.common.tokenizer import load_tokenizer


@dataclass(frozen=True, slots=True)
class Workload:
    """The prompts of a run and how they are sent; the same for every server compared."""

    prompts: list[BenchPrompt]
    warmup_prompts: list[BenchPrompt]
    warmup_timeout_s: float
    load: LoadConfig
    tokenizer: PreTrainedTokenizerBase


def create_workload(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> Workload:
    """The measured prompts, and warm-up prompts from another seed: for shared-prefix they
    have their own prefixes, so warm-up never fills the prefix cache for the measured run."""
    prompts = build_dataset(cli.dataset_config(args, args.num_prompts, args.seed), tokenizer)
    warmup_config = cli.dataset_config(args, args.warmup, args.seed + 1)
    warmup = build_dataset(warmup_config, tokenizer) if args.warmup > 0 else []
    return Workload(prompts, warmup, args.warmup_timeout, cli.load_config(args), tokenizer)


async def run_workload(
    settings: RequestSettings, workload: Workload
) -> tuple[RunOutcome, RunOutcome | None]:
    """Warm-up (all at once within the concurrency limit, not counted), then the run."""
    warmup = None
    if workload.warmup_prompts:
        warmup_load = LoadConfig(max_concurrency=workload.load.max_concurrency)
        warmup_settings = replace(settings, timeout_s=workload.warmup_timeout_s)
        warmup = await run_load(warmup_settings, workload.warmup_prompts, warmup_load)
    outcome = await run_load(settings, workload.prompts, workload.load)
    fill_token_counts(outcome, workload.prompts, workload.tokenizer)
    return outcome, warmup


@dataclass(frozen=True, slots=True)
class BenchRun:
    """A run's report (what goes to JSON) and its raw results (what the plots read)."""

    report: dict[str, Any]
    results: list[RequestResult]


def benchmark(
    name: str, settings: RequestSettings, workload: Workload, args: argparse.Namespace
) -> BenchRun:
    """Run the workload against one server (nothing written)."""
    outcome, warmup = asyncio.run(run_workload(settings, workload))
    dataset = cli.dataset_config(args, args.num_prompts, args.seed)
    num_warmup = len(workload.warmup_prompts)
    config = config_dict(settings, dataset, workload.load, num_warmup, workload.warmup_timeout_s)
    return BenchRun(build_report(name, config, outcome, warmup), outcome.results)


def write_run_files(run: BenchRun, json_path: Path, png_path: Path) -> None:
    write_json(run.report, json_path)
    title = f"{run.report['name']}: {run.report['config']['request']['base_url']}"
    plot_run(run.results, title, png_path)


def resolve_model(base_url: str, api_key: str, fallback: str) -> str:
    """The first model the server lists; `fallback` when it lists none or cannot."""
    try:
        reply = httpx.get(
            f"{base_url.rstrip('/')}/models",
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=10,
        )
        models = reply.json().get("data") or []
        if reply.status_code == 200 and models:
            return str(models[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return fallback


def main(argv: list[str]) -> int:
    args = cli.create_run_parser().parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    model = args.model or resolve_model(args.base_url, args.api_key, Path(args.tokenizer).name)
    settings = RequestSettings(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        timeout_s=args.timeout,
    )
    name = args.name or f"{args.dataset}-{args.endpoint}"
    json_path, png_path = cli.output_paths(args, name)
    run = benchmark(name, settings, create_workload(args, tokenizer), args)
    write_run_files(run, json_path, png_path)
    print("\n".join([*warmup_lines(run.report), *summary_lines(run.report["summary"])]))
    print(f"wrote {json_path} and {png_path}")
    return 0 if run.report["summary"]["failed"] == 0 else 1
