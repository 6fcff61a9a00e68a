"""ModelRunner: a host-side plan in, the sampled rows' logits out, K/V in the planned slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.model_runner import ForwardPlan, ModelRunner
from services.scheduler.model_executor.models.llama import LlamaForCausalLM
from services.scheduler.model_executor.models.loader import load_model

# Two prompts prefilled whole, then a step mixing a prefill chunk with two decodes.
PROMPTS = [[0, *range(1000, 1012)], [0, *range(2000, 2005)], [0, *range(3000, 3020)]]


@pytest.fixture(scope="module")
def model(default_model_dir: Path) -> LlamaForCausalLM:
    model, _ = load_model(default_model_dir, torch.float32, "cpu")
    return model


def new_runner(model: LlamaForCausalLM) -> ModelRunner:
    c = model.config
    pool = KVPool(128, c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
    return ModelRunner(model, pool, "cpu")


def mixed_step(runner: ModelRunner, logit_rows: list[int]) -> tuple[ForwardPlan, torch.Tensor]:
    """Prefill requests 0 and 1 and the first 8 tokens of 2; then run one step holding a
    decode of 0, a decode of 1 and the next chunk of 2, sampling ``logit_rows`` of it."""
    slots = [runner.kv_pool.allocate(len(p) + 1) for p in PROMPTS]
    first = [PROMPTS[0], PROMPTS[1], PROMPTS[2][:8]]
    first_slots = [s[: len(ids)] for s, ids in zip(slots, first, strict=True)]
    runner.forward(ForwardPlan(first, [0, 0, 0], first_slots, []))
    chunks = [[4242], [77], PROMPTS[2][8:]]
    prefix_lens = [len(PROMPTS[0]), len(PROMPTS[1]), 8]
    kv_slots = [s[: p + len(c)] for s, p, c in zip(slots, prefix_lens, chunks, strict=True)]
    plan = ForwardPlan(chunks, prefix_lens, kv_slots, logit_rows)
    return plan, runner.forward(plan)


def test_logits_are_the_sampled_rows_of_a_full_forward(model: LlamaForCausalLM) -> None:
    runner = new_runner(model)
    plan, logits = mixed_step(runner, [0, 2])
    assert logits.dtype == torch.float32 and logits.shape == (2, model.config.vocab_size)
    # The model's own standalone step over the same batch: one row per request.
    batch = ForwardBatch.build(plan.new_token_ids, plan.prefix_lens, plan.kv_slots)
    expected = model(batch, runner.kv_pool)
    torch.testing.assert_close(logits, expected[[0, 2]], atol=3e-4, rtol=0.0)


def test_a_step_that_samples_nothing_still_stores_its_kv(model: LlamaForCausalLM) -> None:
    runner = new_runner(model)
    plan, logits = mixed_step(runner, [])
    assert logits.shape == (0, model.config.vocab_size)
    stored = runner.kv_pool.k_buffers[0][plan.kv_slots[2][8:]]
    assert stored.abs().sum() > 0  # the chunk's K went to its slots though no row sampled


def test_a_decode_step_returns_every_row(model: LlamaForCausalLM) -> None:
    runner = new_runner(model)
    slots = runner.kv_pool.allocate(len(PROMPTS[1]) + 1)
    runner.forward(ForwardPlan([PROMPTS[1]], [0], [slots[:-1]], [0]))
    plan = ForwardPlan([[5]], [len(PROMPTS[1])], [slots], [0])
    logits = runner.forward(plan)
    batch = ForwardBatch.build(plan.new_token_ids, plan.prefix_lens, plan.kv_slots)
    torch.testing.assert_close(logits, model(batch, runner.kv_pool), atol=3e-4, rtol=0.0)
