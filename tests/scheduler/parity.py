"""Helpers that hold our model runtime against HF transformers, for any architecture.

Greedy generation must match token for token; the only divergence allowed is at a step
where HF's own top-2 logits are within NEAR_TIE (a near-tie that summation order may
flip), after which the sequences are no longer comparable.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.standalone_step import StandaloneStep

NEAR_TIE = 1e-4
# Logits here span about +-40; float32 matmuls blocked differently for different batch
# shapes differ by ~1e-4 at that scale, so this is "equal up to fp32 summation order".
FP32_ATOL = 3e-4


def new_pool(config: ModelConfig, num_tokens: int, dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(num_tokens, config.num_layers, config.num_kv_heads, config.head_dim, dtype)


def our_greedy(model: StandaloneStep, config: ModelConfig, prompt: list[int], n: int) -> list[int]:
    """Prefill the whole prompt, then decode one token per step through the KV pool."""
    pool = new_pool(config, len(prompt) + n)
    slots = pool.allocate(len(prompt) + n)
    logits = model(ForwardBatch.build([prompt], [0], [slots[: len(prompt)]]), pool)
    tokens: list[int] = []
    while True:
        tokens.append(int(logits[0].argmax()))
        if len(tokens) == n or tokens[-1] in config.eos_token_ids:
            return tokens
        seq_len = len(prompt) + len(tokens)
        batch = ForwardBatch.build([[tokens[-1]]], [seq_len - 1], [slots[:seq_len]])
        logits = model(batch, pool)


def hf_generate(model: PreTrainedModel, prompt: list[int], n: int) -> Any:
    """HF ``generate``, greedy, ``n`` new tokens, with each step's raw logits kept."""
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=n,
            output_logits=True,
            return_dict_in_generate=True,
        )


def hf_greedy(model: PreTrainedModel, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF greedy tokens and, per step, the gap between its top-2 raw logits."""
    out = hf_generate(model, prompt, n)
    gaps = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1]) for step in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), gaps


def hf_step_logprobs(model: PreTrainedModel, prompt: list[int], n: int) -> list[torch.Tensor]:
    """Per generated token, HF ``generate``'s log-softmax over the vocabulary."""
    return [step[0].float().log_softmax(-1) for step in hf_generate(model, prompt, n).logits]


def assert_same_greedy(label: str, expected: list[int], gaps: list[float], got: list[int]) -> None:
    """``got`` equals HF's ``expected``, or first differs at a step HF itself near-tied."""
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            assert gaps[step] < NEAR_TIE, f"{label}: diverged at step {step} (gap {gaps[step]})"
            return
    assert got == expected, label


def run_alone(model: StandaloneStep, config: ModelConfig, steps: list[list[int]]) -> torch.Tensor:
    """Feed ``steps`` (token chunks) one per forward; return all logits of the last one."""
    pool = new_pool(config, sum(map(len, steps)))
    slots = pool.allocate(sum(map(len, steps)))
    done = 0
    for chunk in steps:
        batch = ForwardBatch.build([chunk], [done], [slots[: done + len(chunk)]])
        logits = model(batch, pool, all_logits=True)
        done += len(chunk)
    return logits


def assert_mixed_batch_matches_alone(
    model: StandaloneStep, config: ModelConfig, reqs: list[list[list[int]]]
) -> None:
    """Per request, earlier steps (token chunks) then the step under test: all final steps
    run in one batch over scattered pool slots and must give each request's logits alone."""
    expected = [run_alone(model, config, steps) for steps in reqs]
    gen = torch.Generator().manual_seed(0)
    pool = new_pool(config, 512)
    free = torch.randperm(512, generator=gen).tolist()  # scattered, interleaved slots
    slots = [[free.pop() for _ in range(sum(map(len, steps)))] for steps in reqs]
    done = [0] * len(reqs)
    num_steps = max(map(len, reqs))
    for step in range(num_steps):
        # Requests with fewer steps start later, so every final step lands in one batch.
        idx = [i for i, steps in enumerate(reqs) if step >= num_steps - len(steps)]
        chunks = [reqs[i][step - num_steps + len(reqs[i])] for i in idx]
        batch = ForwardBatch.build(
            chunks,
            [done[i] for i in idx],
            [slots[i][: done[i] + len(c)] for i, c in zip(idx, chunks, strict=True)],
        )
        logits = model(batch, pool, all_logits=True)
        for i, c in zip(idx, chunks, strict=True):
            done[i] += len(c)
    assert idx == list(range(len(reqs)))
    last = model(batch, pool)  # rerun of the final step: K/V rewrites are idempotent
    start = 0
    for i, chunk in enumerate(chunks):
        rows = logits[start : start + len(chunk)]
        print(f"req {i}: max |batched - alone| = {(rows - expected[i]).abs().max():.2e}")
        torch.testing.assert_close(rows, expected[i], atol=FP32_ATOL, rtol=0.0)
        torch.testing.assert_close(last[i], expected[i][-1], atol=FP32_ATOL, rtol=0.0)
        start += len(chunk)


def all_logits(model: NativeCausalLM, ids: list[int], decode: int) -> torch.Tensor:
    """float32 logits of every position: ``ids[:-decode]`` in one prefill (many rows, the
    dense path), then one decode step per remaining token (few rows: the decode kernels)."""
    dtype = model.model.norm.weight.dtype
    pool = new_pool(model.config, len(ids), dtype)
    slots = pool.allocate(len(ids))
    cut = len(ids) - decode
    out = [model(ForwardBatch.build([ids[:cut]], [0], [slots[:cut]]), pool, all_logits=True)]
    for pos in range(cut, len(ids)):
        batch = ForwardBatch.build([[ids[pos]]], [pos], [slots[: pos + 1]])
        out.append(model(batch, pool))
    return torch.cat(out)
