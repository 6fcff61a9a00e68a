"""Decode attention on CPU: ``tokenline::decode_attention`` alone, warm and from memory.

``python -m bench.decode_attention --model models/tokenline-small`` calls the kernel at the
model's head shape in bf16 for 1, 16 and 64 requests of ``--keys`` keys each, their slots in
order and in random order over a pool of the engine's size, and times each call twice:
warm (the same call repeated) and after reading 64 MiB (as the layers between two calls
evict the pool inside the engine). Prints µs per call and the pool's bytes read per second,
with the CPU; writes JSON (``--out``, default ``bench/results/decode_attention.json``).

To compare two builds of the kernel, run it once per build (``--kernels-dir``): a process
can load one library of the ``tokenline`` ops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from bench.machine import describe, machine_info
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.transport.engine_build import load_kernels

REQUESTS = (1, 16, 64)
# Slots in the pool the calls read from: a few thousand requests' worth, as a served pool.
POOL_SLOTS = 65536
# Read between two timed calls in the "from memory" runs: twice this machine's L3 and more.
SWEEP_BYTES = 64 << 20


def pool_bytes(requests: int, keys: int, kv_heads: int, head_dim: int) -> int:
    """Key and value bytes one call reads: every request's rows of every kv head, bf16."""
    return 2 * requests * keys * kv_heads * head_dim * 2


class Pool(NamedTuple):
    """What every row's calls read: the KV pool's buffers, and the bytes read between two
    calls to evict them. Built once per run (the Qwen3-0.6B shape's pool is 0.27 GB)."""

    k_buf: torch.Tensor
    v_buf: torch.Tensor
    sweep: torch.Tensor

    @classmethod
    def of(cls, config: ModelConfig) -> Pool:
        gen = torch.Generator().manual_seed(0)
        shape = (POOL_SLOTS, config.num_kv_heads, config.head_dim)
        return cls(
            torch.randn(shape, generator=gen).bfloat16(),
            torch.randn(shape, generator=gen).bfloat16(),
            torch.ones(SWEEP_BYTES, dtype=torch.uint8),  # real pages: not the zero page
        )


def measure(
    config: ModelConfig, pool: Pool, requests: int, keys: int, layout: str, repeats: int
) -> dict[str, float | int | str]:
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    gen = torch.Generator().manual_seed(requests)
    q = torch.randn(requests, heads, head_dim, generator=gen).bfloat16()
    if layout == "in order":  # each request's keys in one run of slots, as a fresh pool
        table = torch.arange(requests * keys).reshape(requests, keys)
    else:
        table = torch.randperm(POOL_SLOTS, generator=gen)[: requests * keys]
        table = table.reshape(requests, keys)
    lens = torch.full((requests,), keys)
    scale = head_dim**-0.5

    def call() -> None:
        torch.ops.tokenline.decode_attention(q, pool.k_buf, pool.v_buf, table, lens, scale)

    row: dict[str, float | int | str] = {"requests": requests, "keys": keys, "layout": layout}
    for name, evict in (("warm", False), ("from_memory", True)):
        for _ in range(5):
            call()
        times = []
        for _ in range(repeats):
            if evict:
                pool.sweep.max()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        row[f"{name}_us"] = seconds * 1e6
        row[f"{name}_gbps"] = pool_bytes(requests, keys, kv_heads, head_dim) / seconds / 1e9
    return row


def line(row: dict[str, float | int | str]) -> str:
    """One row as printed: the call's time and the pool's bytes a second, both ways."""
    timings = ", ".join(
        f"{name} {row[f'{key}_us']:7.1f} µs ({row[f'{key}_gbps']:5.1f} GB/s)"
        for name, key in (("warm", "warm"), ("from memory", "from_memory"))
    )
    return f"{row['requests']:3d} requests, slots {row['layout']:8s}: {timings}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/tokenline-small")
    parser.add_argument("--kernels-dir", default="", help="a folder of built kernels")
    parser.add_argument("--keys", type=int, default=180, help="keys per request")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default="bench/results/decode_attention.json")
    args = parser.parse_args()
    if not load_kernels(args.model, torch.device("cpu"), args.kernels_dir).decode_attention:
        raise SystemExit("no kernels are built for this CPU: run `make kernels` first")
    config = ModelConfig.from_dir(args.model)
    info = machine_info()
    print(f"machine: {describe(info)}")
    print(
        f"heads {config.num_heads} over {config.num_kv_heads}, head_dim {config.head_dim}, "
        f"bf16, {args.keys} keys a request"
    )
    pool = Pool.of(config)
    rows = [
        measure(config, pool, requests, args.keys, layout, args.repeats)
        for requests in REQUESTS
        for layout in ("in order", "random")
    ]
    for row in rows:
        print(line(row))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "model": args.model, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
