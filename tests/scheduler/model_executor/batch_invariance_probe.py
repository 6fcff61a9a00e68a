"""Batch invariance at the level of the model forward plus greedy sampling, in one process.

``python -m tests.scheduler.model_executor.batch_invariance_probe --model DIR`` loads the model in
batch-invariant mode (bfloat16 and float32; SDPA and compiled decode paths), runs a target
request alone, then again inside batches of 3 to 64 requests whose prompts have other
lengths (so every padded and tiled shape moves), some prefilling beside the target's
prefill and some beside its decode steps. It prints one JSON list: the target's logits
rows and greedy tokens must be bit-identical in every batch. ``test_batch_invariance.py``
runs it once per ISA cap the CPU allows (``ONEDNN_MAX_CPU_ISA`` and ``ATEN_CPU_CAPABILITY``
are read when the process starts).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.sampling_params import SamplingParams
from services.scheduler.core.req import Req
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.model_runner import ForwardPlan, ModelRunner
from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.model_executor.row_kernels import use_row_kernels
from services.scheduler.ops.cpu_kernels import SampleKernel, is_registered
from services.scheduler.sampling.sampler import Sampler

BATCH_SIZES = (3, 17, 64)
DECODE_STEPS = 2
TARGET_LEN = 19
MAX_OTHER_LEN = 24
POOL_TOKENS = 64 * (MAX_OTHER_LEN + DECODE_STEPS + 2)


@dataclass
class Running:
    """One request of a probe run: its tokens so far and its pool slots."""

    req: Req
    tokens: list[int]
    slots: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the pool


@dataclass
class Trace:
    """What the target saw at each step: its logits row and its greedy token."""

    logits: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class Probe:
    """A model in batch-invariant mode over a fresh pool for each run."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        model, self.config = load_model(model_dir, dtype, "cpu", batch_invariant=True)
        c = self.config
        pool = KVPool(POOL_TOKENS, c.num_layers, c.num_kv_heads, c.head_dim, dtype)
        self.model = model
        self.runner = ModelRunner(model, pool, "cpu")
        self.sampler = Sampler()

    def use_compiled_kernels(self, kernel: SampleKernel | None) -> None:
        """The compiled decode attention, row kernels and sampler (``kernel``), or the
        eager paths."""
        self.runner.attn_backend.decode_kernel = kernel is not None  # type: ignore[attr-defined]
        use_row_kernels(self.model, kernel is not None and is_registered("rms_norm"))
        self.sampler.kernel = kernel

    def run(self, target: list[int], others: list[list[int]], position: int) -> Trace:
        """The target's trace when it runs at ``position`` among ``others``: the even
        others prefill beside its prefill, the odd ones join at its first decode step."""
        reqs = [_running(f"o{i}", p) for i, p in enumerate(others)]
        first, late = reqs[0::2], reqs[1::2]
        me = _running("target", target)
        batch = [*first[:position], me, *first[position:]]
        trace, next_slot = Trace(), 0
        for step in range(DECODE_STEPS + 1):
            if step == 1:
                batch += late
            next_slot = self._step(batch, next_slot, me, trace)
        return trace

    def _step(self, batch: list[Running], next_slot: int, me: Running, trace: Trace) -> int:
        new_ids = [r.tokens[r.num_computed :] for r in batch]
        prefix_lens = [r.num_computed for r in batch]
        for r, ids in zip(batch, new_ids, strict=True):
            r.slots += range(next_slot, next_slot + len(ids))
            next_slot += len(ids)
        plan = ForwardPlan(new_ids, prefix_lens, [r.slots for r in batch], list(range(len(batch))))
        logits = self.runner.forward(plan)
        mine = batch.index(me)
        trace.logits.append(logits[mine].float().clone())
        tokens = self.sampler.sample(logits, [r.req for r in batch]).token_ids
        for r, token in zip(batch, tokens, strict=True):
            r.num_computed = len(r.tokens)
            r.tokens.append(token)
        trace.tokens.append(tokens[mine])
        return next_slot


def _running(rid: str, prompt: list[int]) -> Running:
    req = Req(rid=rid, input_ids=list(prompt), params=SamplingParams(temperature=0.0))
    return Running(req, list(prompt))


def differences(alone: Trace, batched: Trace, size: int) -> list[str]:
    """Each step where the batched trace is not bit-identical to the lone one."""
    found = []
    for step, (a, b) in enumerate(zip(alone.logits, batched.logits, strict=True)):
        if not torch.equal(a, b):
            delta = (a - b).abs().max().item()
            found.append(f"batch of {size}, step {step}: logits differ by up to {delta:.3g}")
    if alone.tokens != batched.tokens:
        found.append(f"batch of {size}: tokens {batched.tokens} != alone {alone.tokens}")
    return found


def check(probe: Probe) -> tuple[int, list[str]]:
    """(steps checked, differences) of one target against batches of every size."""
    rng = random.Random(0)
    vocab = probe.config.vocab_size
    target = [rng.randrange(vocab) for _ in range(TARGET_LEN)]
    alone = probe.run(target, [], 0)
    found: list[str] = []
    checked = 0
    for size in BATCH_SIZES:
        others = [
            [rng.randrange(vocab) for _ in range(rng.randint(1, MAX_OTHER_LEN))]
            for _ in range(size - 1)
        ]
        found += differences(alone, probe.run(target, others, rng.randrange(size // 2 + 1)), size)
        checked += len(alone.tokens)
    return checked, found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument(
        "--skip-kernel",
        action="store_true",
        help="only the eager decode path (the compiled one does not change with an ISA cap)",
    )
    args = p.parse_args(argv)
    # One thread: what is checked is that every shape a row meets is fixed, which holds at
    # any thread count, and a second thread only spins against the rest of the suite.
    torch.set_num_threads(1)
    kernel = None if args.skip_kernel else SampleKernel.load(args.model)
    paths = {"sdpa": None} | (
        {"kernel": kernel} if kernel and is_registered("decode_attention") else {}
    )
    reports = []
    for dtype in ("bfloat16", "float32"):
        probe = Probe(args.model, getattr(torch, dtype))
        for path, path_kernel in paths.items():
            probe.use_compiled_kernels(path_kernel)
            steps, found = check(probe)
            reports.append({"dtype": dtype, "decode": path, "steps": steps, "differences": found})
    print(json.dumps(reports))


if __name__ == "__main__":
    main()
