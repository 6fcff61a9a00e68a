"""Prompt attention on CPU, torch's flash kernel against ``tokenline::prompt_attention``.

``python -m bench.prompt_attention --model models/tokenline-small`` runs one layer's
attention of a prefill span through the torch backend both ways, alternating, at the
model's head shape in bf16: prompts of 128, 450 and 1,024 tokens, and chunks after a cached
prefix (short, padded by the torch path; long, split by it). Prints ms per call, GFLOP/s
(the causal products only) and the kernel's time over torch's, with the CPU; writes JSON
(``--out``, default ``bench/results/prompt_attention.json``).

The backend picks the kernel by itself only where the CPU has no AMX; here both run on any
CPU whose kernels are built at the avx512_bf16 level.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.machine import describe, machine_info
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention.torch_backend import TorchAttentionBackend
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.transport.engine_build import load_kernels

# (cached prefix, chunk): whole prompts, then chunks after a short and a long prefix.
SPANS = ((0, 128), (0, 450), (0, 1024), (64, 450), (1024, 1024))


def causal_flops(prefix: int, length: int, heads: int, head_dim: int) -> float:
    """Multiply-adds of both products, as 2 FLOPs each, over the keys each query sees."""
    keys_seen = length * prefix + length * (length + 1) / 2
    return 2 * 2 * keys_seen * head_dim * heads


def time_calls(backend: TorchAttentionBackend, step: dict, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.forward(**step)
        times.append(time.perf_counter() - start)
    return times


def measure(config: ModelConfig, prefix: int, length: int, rounds: int) -> dict[str, float]:
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    gen = torch.Generator().manual_seed(prefix + length)
    pool = KVPool(prefix + length, 1, kv_heads, head_dim, torch.bfloat16)
    pool.k_buffers[0].copy_(torch.randn(prefix + length, kv_heads, head_dim, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(prefix + length, kv_heads, head_dim, generator=gen))
    batch = ForwardBatch.build([[0] * length], [prefix], [list(range(prefix + length))])
    step = {
        "q": torch.randn(length, heads, head_dim, generator=gen).bfloat16(),
        "k": torch.randn(length, kv_heads, head_dim, generator=gen).bfloat16(),
        "v": torch.randn(length, kv_heads, head_dim, generator=gen).bfloat16(),
        "layer": 0,
        "kv_pool": pool,
        "scale": head_dim**-0.5,
    }
    backends = {"torch": TorchAttentionBackend(), "kernel": TorchAttentionBackend()}
    backends["kernel"].prompt_kernel = True
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(rounds):  # alternating, so both see the same machine
        for name, backend in backends.items():
            step["meta"] = backend.plan(batch)
            times[name] += time_calls(backend, step, repeats=5)
    flops = causal_flops(prefix, length, heads, head_dim)
    row = {"prefix": prefix, "length": length}
    for name, samples in times.items():
        row[f"{name}_ms"] = statistics.median(samples) * 1e3
        row[f"{name}_gflops"] = flops / statistics.median(samples) / 1e9
    row["kernel_over_torch"] = row["kernel_ms"] / row["torch_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/tokenline-small")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="bench/results/prompt_attention.json")
    args = parser.parse_args()
    load_kernels(args.model, torch.device("cpu"))
    if not torch.ops.tokenline.prompt_attention_fits(64):
        raise SystemExit(
            "the kernels here are not built at the avx512_bf16 level: nothing to compare"
        )
    config = ModelConfig.from_dir(args.model)
    info = machine_info()
    print(f"machine: {describe(info)}")
    print(f"heads {config.num_heads} over {config.num_kv_heads}, head_dim {config.head_dim}, bf16")
    rows = []
    for prefix, length in SPANS:
        row = measure(config, prefix, length, args.rounds)
        rows.append(row)
        print(
            f"prefix {prefix:5d} chunk {length:5d}: torch {row['torch_ms']:7.2f} ms "
            f"({row['torch_gflops']:4.0f} GFLOP/s), kernel {row['kernel_ms']:7.2f} ms "
            f"({row['kernel_gflops']:4.0f} GFLOP/s): {row['kernel_over_torch']:.2f}x the time"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
