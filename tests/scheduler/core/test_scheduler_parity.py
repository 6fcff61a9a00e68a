"""The scheduler's own greedy tokens equal HF's greedy choices, under continuous
batching, chunked prefill and prefix-cache hits."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.scheduler.mem_cache.radix_cache import common_prefix_len
from tests.scheduler.factories import (
    assert_kv_conserved,
    assert_kv_returns_to_pool,
    make_req,
    make_scheduler,
    run_to_completion,
)

NEW_TOKENS = 16
NEAR_TIE = 1e-4
SYSTEM = "You are a careful assistant. Answer briefly and cite the rules you used. " * 6
TABLE = " ".join(f"item {i}: value {i * 7 % 13};" for i in range(40))
# rid -> (text, arrival step). Several share long prefixes with an earlier prompt, and
# the table (~320 tokens) is prefilled in chunks while the others decode.
PROMPTS = {
    "short": ("Hello", 0),
    "sys-a": (SYSTEM + "What is two plus two?", 1),
    "table": (TABLE, 2),
    "fox": ("The quick brown fox jumps over the lazy dog. " * 3, 4),
    "sys-b": (SYSTEM + "Name a prime number.", 8),
    "sys-c": (SYSTEM + "Why is the sky blue?", 12),
    "table-tail": (TABLE[: len(TABLE) * 3 // 4] + " and the total is", 24),
    "sys-a-again": (SYSTEM + "What is two plus two?", 30),
}
SHARERS = {"sys-b", "sys-c", "table-tail", "sys-a-again"}


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return {
        rid: [0, *tokenizer.encode(text, add_special_tokens=False)]
        for rid, (text, _) in PROMPTS.items()
    }


def assert_hf_greedy(hf_model, prompt: list[int], got: list[int]) -> None:
    """Each of our tokens is HF's argmax given the tokens before it, i.e. what HF greedy
    generate picks, checked with one teacher-forced HF forward. A divergence is only
    allowed at a near-tie, after which the sequences legitimately differ."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1]
    top2 = logits.topk(2, dim=-1)
    for step, have in enumerate(got):
        want = int(top2.indices[step, 0])
        if want != have:
            gap = float(top2.values[step, 0] - top2.values[step, 1])
            assert gap < NEAR_TIE, f"diverged at step {step} (HF top-2 gap {gap})"
            return


def expected_cached(rid: str, prompts: dict[str, list[int]]) -> int:
    """Longest prefix shared with a prompt that arrived earlier, leaving one token to compute."""
    mine, arrival = prompts[rid], PROMPTS[rid][1]
    shared = [
        common_prefix_len(other, mine, 0)
        for other_rid, other in prompts.items()
        if PROMPTS[other_rid][1] < arrival
    ]
    return min(max(shared, default=0), len(mine) - 1)


@pytest.fixture(params=["sdpa", "decode-kernel"])
def decode_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Decode attention by torch's SDPA, or by the compiled kernel (built for the test)."""
    if request.param == "sdpa":
        yield request.param
        return
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("the kernel needs a C++ compiler")
    request.getfixturevalue("kernel_model_dir")  # builds and loads the library
    yield request.param


def test_staggered_batched_greedy_matches_hf(
    default_model_dir: Path, prompts: dict[str, list[int]], hf_model, decode_path: str
) -> None:
    # A small token budget forces chunked prefill of the long prompts while others decode.
    scheduler = make_scheduler(default_model_dir, max_num_batched_tokens=64)
    backend = scheduler.runner.model.attn_backend  # the cached model's: reset below
    backend.decode_kernel = decode_path == "decode-kernel"
    try:
        _check_staggered_batch(scheduler, prompts, hf_model)
    finally:
        backend.decode_kernel = False


def _check_staggered_batch(scheduler, prompts: dict[str, list[int]], hf_model) -> None:
    reqs = {
        rid: make_req(rid, prompts[rid], temperature=0.0, max_new_tokens=NEW_TOKENS)
        for rid in PROMPTS
    }
    arrivals: dict[int, list] = {}
    for rid, (_, step) in PROMPTS.items():
        arrivals.setdefault(step, []).append(reqs[rid])
    tokens = run_to_completion(
        scheduler, arrivals, after_step=lambda _: assert_kv_conserved(scheduler)
    )

    for rid, prompt in prompts.items():
        assert len(tokens[rid]) == NEW_TOKENS or reqs[rid].finish.matched is not None, rid
        assert_hf_greedy(hf_model, prompt, tokens[rid])
        assert reqs[rid].num_cached_tokens == expected_cached(rid, prompts), rid
    for rid in SHARERS:
        assert reqs[rid].num_cached_tokens > 40, rid
    assert_kv_returns_to_pool(scheduler)
