"""The transformers path (``--model-impl transformers``) inside the scheduler core, against
transformers' own float32 forward and ``generate``, on architectures tokenline has no
native code for (tiny random checkpoints built here: ``tests/tiny_checkpoints.py``), one
of them a mixture of experts (OLMoE).

Covered per architecture: greedy continuations of mixed-length prompts in one batch equal
HF ``generate`` (a divergence only where HF's top-2 logits are within 1e-4); the same
requests one at a time give the same tokens; a prefix-cache hit and chunked prefill give
the same tokens; prompt logprobs within 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.model_executor.models.transformers_model import TransformersCausalLM
from tests.scheduler.factories import (
    assert_kv_returns_to_pool,
    make_req,
    make_scheduler,
    run_collecting_rows,
    run_to_completion,
)
from tests.scheduler.parity import NEAR_TIE, hf_greedy
from tests.scheduler.sampling.test_prompt_logprobs import (
    assert_matches_hf,
    load_hf_references,
    prompt_entries,
    scoring_req,
)
from tests.tiny_checkpoints import ARCHITECTURES, MOE_ARCHITECTURES, build_checkpoint

NEW_TOKENS = 8
ALONE = ("fox", "sys-b")  # one at a time: a plain prompt and the cache sharer
SYSTEM = "You are a careful assistant. Answer briefly and cite the rules you used. " * 3
PROMPTS = {
    "short": "Hello",
    "fox": "The quick brown fox jumps over the lazy dog. " * 2,
    "table": " ".join(f"item {i}: value {i * 7 % 13};" for i in range(12)),
    "sys-a": SYSTEM + "What is two plus two?",
}
SHARER = ("sys-b", SYSTEM + "Name a prime number.")  # arrives later: a radix-cache hit


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES) + sorted(MOE_ARCHITECTURES))
def checkpoint(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
) -> Path:
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return build_checkpoint(request.param, out, default_model_dir)


@pytest.fixture(scope="module")
def hf_references(checkpoint: Path) -> dict[torch.dtype, PreTrainedModel]:
    return load_hf_references(checkpoint)


@pytest.fixture(scope="module")
def hf_model(hf_references: dict[torch.dtype, PreTrainedModel]) -> PreTrainedModel:
    return hf_references[torch.float32]


@pytest.fixture(scope="module")
def prompts(checkpoint: Path) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts = {**PROMPTS, SHARER[0]: SHARER[1]}
    return {rid: [0, *tokenizer.encode(t, add_special_tokens=False)] for rid, t in texts.items()}


def assert_same_until_near_tie(want: list[int], got: list[int], gaps: list[float]) -> None:
    """Equal, or equal up to a step where HF's own top-2 logits were within NEAR_TIE."""
    for step, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            assert gaps[step] < NEAR_TIE, f"diverged at step {step} (HF top-2 gap {gaps[step]})"
            return
    assert got == want


def greedy_tokens(checkpoint: Path, prompts: dict[str, list[int]], arrivals, **config) -> dict:
    scheduler = make_scheduler(checkpoint, **config)
    reqs = {
        rid: make_req(rid, prompts[rid], temperature=0.0, max_new_tokens=NEW_TOKENS)
        for rid in prompts
    }
    tokens = run_to_completion(
        scheduler, {step: [reqs[rid] for rid in rids] for step, rids in arrivals.items()}
    )
    assert_kv_returns_to_pool(scheduler)
    return tokens, reqs


def test_loads_through_transformers(checkpoint: Path) -> None:
    model, config = load_model(checkpoint, torch.float32, "cpu")
    assert isinstance(model, TransformersCausalLM)
    assert config.architecture in {
        "Olmo2ForCausalLM",
        "GraniteForCausalLM",
        "CohereForCausalLM",
        "OlmoeForCausalLM",  # MoE: its per-expert checkpoint tensors fused on load
    }


def test_batched_chunked_and_cached_greedy_match_hf_generate(
    checkpoint: Path, prompts: dict[str, list[int]], hf_model: PreTrainedModel
) -> None:
    """All prompts in one batch, chunked (16 tokens a step), the sharer arriving after
    ``sys-a`` is cached; then two of them alone, unchunked and uncached."""
    arrivals = {0: list(PROMPTS), 12: [SHARER[0]]}
    batched, reqs = greedy_tokens(checkpoint, prompts, arrivals, max_num_batched_tokens=16)
    assert reqs[SHARER[0]].num_cached_tokens > 20  # the shared system prompt
    for rid, prompt in prompts.items():
        want, gaps = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert_same_until_near_tie(want, batched[rid], gaps)
        if rid in ALONE:
            alone, _ = greedy_tokens(checkpoint, {rid: prompt}, {0: [rid]})
            assert_same_until_near_tie(want, alone[rid], gaps)
        print(f"{rid}: {len(prompt)} prompt tokens, {len(batched[rid])} tokens match HF generate")


def test_prompt_logprobs_match_hf(
    checkpoint: Path,
    prompts: dict[str, list[int]],
    hf_references: dict[torch.dtype, PreTrainedModel],
) -> None:
    scheduler = make_scheduler(checkpoint, max_num_batched_tokens=16)
    table = prompts["table"]
    rows = run_collecting_rows(scheduler, {0: [scoring_req("table", table, 0)]})["table"]
    assert_matches_hf(hf_references, table, 0, prompt_entries(rows))
    assert_kv_returns_to_pool(scheduler)
