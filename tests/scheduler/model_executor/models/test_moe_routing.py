"""Mixture-of-experts routing against HF: a batch whose tokens all choose the same experts
(forced by the router weights, not by luck: tests/checkpoints.py's ``force_routing``), and
one whose tokens spread over the experts. Logits and greedy tokens must match HF in both,
and on the transformers path too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.loader import load_model
from tests.checkpoints import MOE_ARCHITECTURES, NUM_EXPERTS, TOP_K, build_hf_model, save_checkpoint
from tests.scheduler.parity import assert_same_greedy, hf_greedy, new_pool, our_greedy

TEXT = " ".join(f"item {i}: value {i * 7 % 13};" for i in range(6))
NEW_TOKENS = 8


def hf_choices(hf_model: PreTrainedModel, ids: list[int]) -> list[torch.Tensor]:
    """Per sparse layer, the [T, top_k] experts HF's router picks for each token."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_router_logits=True)
    return [logits.topk(TOP_K, dim=-1).indices for logits in out.router_logits]


def assert_matches_hf(
    hf_model: PreTrainedModel, out_dir: Path, ids: list[int], model_impl: str = "native"
) -> None:
    model, config = load_model(out_dir, torch.float32, "cpu", model_impl=model_impl)
    pool = new_pool(config, len(ids))
    got = model(ForwardBatch.build([ids], [0], [pool.allocate(len(ids))]), pool, all_logits=True)
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=3e-4, rtol=0.0)
    expected, gaps = hf_greedy(hf_model, ids, NEW_TOKENS)
    assert_same_greedy("moe", expected, gaps, our_greedy(model, config, ids, NEW_TOKENS))


@pytest.fixture(scope="module")
def ids(default_model_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [0, *tokenizer.encode(TEXT, add_special_tokens=False)]


@pytest.mark.parametrize("name", MOE_ARCHITECTURES)
def test_all_tokens_on_the_same_experts(
    name: str, ids: list[int], tmp_path: Path, default_model_dir: Path
) -> None:
    hf_model = build_hf_model(name, force_routing=True)
    choices = hf_choices(hf_model, ids)
    assert choices and all(
        torch.equal(c.sort(dim=-1).values, torch.tensor([[0, 1]]).expand_as(c)) for c in choices
    )
    assert_matches_hf(hf_model, save_checkpoint(hf_model, tmp_path, default_model_dir), ids)


@pytest.mark.parametrize("name", MOE_ARCHITECTURES)
def test_tokens_spread_over_the_experts(
    name: str, ids: list[int], tmp_path: Path, default_model_dir: Path
) -> None:
    hf_model = build_hf_model(name)
    for layer_choices in hf_choices(hf_model, ids):
        assert len(set(layer_choices[:, 0].tolist())) >= NUM_EXPERTS - 1  # top-1 spreads
    assert_matches_hf(hf_model, save_checkpoint(hf_model, tmp_path, default_model_dir), ids)


@pytest.mark.parametrize("name", MOE_ARCHITECTURES)
def test_the_transformers_path_serves_them_too(
    name: str, ids: list[int], tmp_path: Path, default_model_dir: Path
) -> None:
    """``--model-impl transformers`` on a natively served MoE: transformers fuses the
    checkpoint's per-expert tensors on load, and its own MoE block gives HF's logits."""
    hf_model = build_hf_model(name)
    out_dir = save_checkpoint(hf_model, tmp_path, default_model_dir)
    assert_matches_hf(hf_model, out_dir, ids, model_impl="transformers")
