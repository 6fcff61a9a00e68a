"""A mixture-of-experts model against a dense one with the same active parameters.

``python -m bench.moe_vs_dense`` builds two random Qwen3-family checkpoints with
transformers' own classes (no download): a Qwen3-MoE whose ``--top-k`` experts of
``--expert-size`` add up to one dense MLP of ``top_k * expert_size``, and that dense Qwen3.
Everything else (attention, layers, vocabulary) is equal, so the gap is what routing and
the expert-grouped matmuls cost over one dense matmul. Both run on the native path;
``ModelRunner.run`` (forward plus the LM head of the sampled rows) is timed for a prefill
and for decode steps, the two models interleaved in every round. Writes
``bench/results/moe_vs_dense.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from bench.machine import describe, machine_info
from bench.model_impl import create_runner, decode_plan, median_ms, prefill_plan
from services.scheduler.transport.heap import keep_heap


def build_checkpoints(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The MoE and the dense checkpoint under ``root``, random and seeded."""
    shared: dict[str, Any] = dict(
        vocab_size=151_936,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    moe_config = Qwen3MoeConfig(
        **shared,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_size,
        norm_topk_prob=True,
        mlp_only_layers=[],
    )
    dense_config = Qwen3Config(**shared, intermediate_size=args.top_k * args.expert_size)
    paths = {"moe": root / "moe", "dense": root / "dense"}
    Qwen3MoeForCausalLM(moe_config).save_pretrained(paths["moe"])
    Qwen3ForCausalLM(dense_config).save_pretrained(paths["dense"])
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-size", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the models' dtype (bfloat16 is what serving picks on a CPU with AVX512_BF16)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/moe_vs_dense.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    keep_heap()  # as the scheduler's engine process does by default
    num_tokens = max(args.concurrency) * args.prompt_len
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_checkpoints(Path(tmp), args)
        runners = {
            name: create_runner(str(path), "native", num_tokens, getattr(torch, args.dtype))
            for name, path in paths.items()
        }
    cases = {f"prefill {args.prompt_len}": prefill_plan(args.prompt_len)}
    cases.update({f"decode C={c}": decode_plan(c, args.prompt_len) for c in args.concurrency})
    info = machine_info()
    print(describe(info), f"torch threads {args.num_threads}, {args.dtype}")
    results = {}
    for name, plan in cases.items():
        ms = median_ms({m: functools.partial(runners[m].run, plan) for m in runners}, args.repeats)
        results[name] = ms | {"moe_over_dense": ms["moe"] / ms["dense"]}
        print(
            f"{name:14s} moe {ms['moe']:8.2f} ms  dense {ms['dense']:8.2f} ms  "
            f"moe/dense {ms['moe'] / ms['dense']:.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"machine": info, "args": vars(args) | {"out": str(args.out)}, "results": results},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
