"""The scheduler's own greedy tokens equal HF generate, under continuous batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.scheduler.factories import make_req, make_scheduler, run_to_completion

NEW_TOKENS = 32
NEAR_TIE = 1e-4
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. " * 3,
    " ".join(f"item {i}: value {i * 7 % 13};" for i in range(40)),
]


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, HF greedy tokens, HF top-2 gap per step) for each prompt."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    out = []
    for text in PROMPTS:
        prompt = [0, *tokenizer.encode(text, add_special_tokens=False)]
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
        gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in gen.logits]
        out.append((prompt, gen.sequences[0, len(prompt) :].tolist(), gaps))
    return out


def assert_matches(got: list[int], expected: list[int], gaps: list[float]) -> None:
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            assert gaps[step] < NEAR_TIE, f"diverged at step {step} (HF top-2 gap {gaps[step]})"
            return
    assert got == expected


def test_staggered_batched_greedy_matches_hf(default_model_dir: Path, reference) -> None:
    # A small token budget forces chunked prefill of the long prompt while others decode.
    scheduler = make_scheduler(default_model_dir, max_num_batched_tokens=64)
    arrivals = {
        i * 3: [make_req(f"r{i}", prompt, temperature=0.0, max_new_tokens=NEW_TOKENS)]
        for i, (prompt, _, _) in enumerate(reference)
    }
    tokens = run_to_completion(scheduler, arrivals)
    for i, (_, expected, gaps) in enumerate(reference):
        assert len(tokens[f"r{i}"]) >= min(NEW_TOKENS, len(expected))
        assert_matches(tokens[f"r{i}"], expected, gaps)
    assert scheduler.kv_pool.num_free == scheduler.kv_pool.num_tokens
