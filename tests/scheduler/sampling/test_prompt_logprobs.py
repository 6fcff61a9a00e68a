"""Prompt logprobs from the scheduler core (float32) against HF transformers in float64.

Every scored prompt position p must hold log_softmax(HF logits at p - 1)[prompt[p]] within
a tolerance, its rank must be HF's, and its top-N ids HF's top-N (up to ties closer than the
tolerance). The tolerance is measured, not guessed: twice how far HF's own float32 forward
of the same prompt lands from its float64 one (never below ``MIN_ATOL``). Float32 error
depends on the CPU's kernels (~1e-3 in logprob on the random default model, whose logits
reach 40), so a fixed bound would pass on one CPU and fail on another; a wrong position,
row or chunk boundary is off by far more. Covered: a prompt longer than one prefill chunk,
prompts partly served from the prefix cache, a request retracted in the middle of its prompt, and
max_new_tokens 0 (score only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from services.common.errors import InvalidArgumentError
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import Req
from services.scheduler.sampling.prompt_logprobs import (
    ROWS_PER_PASS,
    PromptLogprob,
    PromptLogprobState,
    score_rows,
)
from tests.scheduler.factories import (
    assert_kv_returns_to_pool,
    make_req,
    make_scheduler,
    run_collecting_rows,
)

MIN_ATOL = 1e-4
NUM_TOP = 5
SYSTEM = "You are a careful assistant. Answer briefly and cite the rules you used. " * 4
TABLE = " ".join(f"item {i}: value {i * 7 % 13};" for i in range(40))


def load_hf_references(model_dir: Path) -> dict[torch.dtype, PreTrainedModel]:
    """HF's forward in float64 (the reference) and float32 (the yardstick for the tolerance).
    The float64 one computes MoE experts in transformers' eager loop: its default grouped
    matmul takes no float64."""
    return {
        torch.float64: AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float64, experts_implementation="eager"
        ).eval(),
        torch.float32: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
    }


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> dict[torch.dtype, PreTrainedModel]:
    return load_hf_references(default_model_dir)


@pytest.fixture(scope="module")
def encode(default_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return lambda text: [0, *tokenizer.encode(text, add_special_tokens=False)]


def scoring_req(rid: str, prompt: list[int], start: int, **params: object) -> Req:
    req = make_req(rid, prompt, temperature=0.0, **{"max_new_tokens": 0, **params})
    req.prompt_logprobs = PromptLogprobState.create(prompt, start, NUM_TOP)
    return req


def prompt_entries(rows: list[OutputRow]) -> list[PromptLogprob]:
    """The request's prompt logprobs: all on one row, never split or repeated."""
    carrying = [r for r in rows if r.input_logprobs]
    assert len(carrying) == 1
    return list(carrying[0].input_logprobs)


def assert_matches_hf(
    references: dict[torch.dtype, PreTrainedModel],
    prompt: list[int],
    start: int,
    got: list[PromptLogprob],
) -> None:
    with torch.no_grad():
        ref, ref32 = (
            torch.log_softmax(references[dtype](torch.tensor([prompt])).logits[0].double(), dim=-1)
            for dtype in (torch.float64, torch.float32)
        )
    atol = max(MIN_ATOL, 2 * float((ref32 - ref).abs().max()))
    assert [e.token_id for e in got] == prompt[start:]
    if start == 0:
        assert got[0].logprob is None and got[0].top == ()
        got = got[1:]
    first = max(start, 1)
    rows = ref[first - 1 : len(prompt) - 1]  # row i scores prompt[first + i]
    want = rows.gather(1, torch.tensor(prompt[first:]).unsqueeze(1))
    # Rank as vLLM defines it, bounded where other tokens sit within atol of the token.
    surely_above = (rows > want + atol).sum(dim=-1).tolist()
    maybe_above = (rows > want - atol).sum(dim=-1).tolist()
    want_top = rows.topk(NUM_TOP, dim=-1)
    for i, entry in enumerate(got):
        assert entry.logprob is not None and abs(entry.logprob - float(want[i])) < atol, i
        assert surely_above[i] + 1 <= entry.rank <= maybe_above[i] + 1, i
        assert len(entry.top) == NUM_TOP
        for j, (token, value) in enumerate(entry.top):
            assert abs(value - float(rows[i, token])) < atol, (i, j)
            if token != int(want_top.indices[i, j]):  # only a near-tie may reorder
                assert abs(float(want_top.values[i, j]) - value) < atol, (i, j)


def test_prompt_longer_than_a_chunk_matches_hf(hf_model, encode, default_model_dir: Path) -> None:
    prompt = encode(TABLE)
    assert len(prompt) > 4 * 64
    scheduler = make_scheduler(default_model_dir, max_num_batched_tokens=64)
    rows = run_collecting_rows(scheduler, {0: [scoring_req("table", prompt, 0)]})["table"]
    assert_matches_hf(hf_model, prompt, 0, prompt_entries(rows))
    assert rows[-1].finish is not None and rows[-1].finish.kind == "length"
    assert rows[-1].new_token_ids == () and rows[-1].num_output_tokens == 0
    assert_kv_returns_to_pool(scheduler)


def test_prompts_partly_served_from_the_prefix_cache_match_hf(
    hf_model, encode, default_model_dir: Path
) -> None:
    prefix = encode(SYSTEM)
    full = encode(SYSTEM + "What is two plus two? " + TABLE[:200])
    assert full[: len(prefix) - 1] == prefix[:-1]
    scheduler = make_scheduler(default_model_dir, max_num_batched_tokens=64)
    run_collecting_rows(
        scheduler, {0: [make_req("prefix", prefix, temperature=0.0, max_new_tokens=2)]}
    )
    # Scored from inside the cached prefix: the cache serves KV up to start - 1 only.
    start = len(prefix) - 10
    late = scoring_req("late", full, start)
    # Scored from the beginning: nothing may come from the cache.
    whole = scoring_req("whole", full, 0, max_new_tokens=3)
    rows = run_collecting_rows(scheduler, {0: [late], 30: [whole]})
    assert late.num_cached_tokens == start - 1
    assert whole.num_cached_tokens == 0
    assert_matches_hf(hf_model, full, start, prompt_entries(rows["late"]))
    assert_matches_hf(hf_model, full, 0, prompt_entries(rows["whole"]))
    # Generating after scoring: the prompt logprobs come with the first token's row.
    assert sum(len(r.new_token_ids) for r in rows["whole"]) == 3
    assert rows["whole"][0].input_logprobs
    assert_kv_returns_to_pool(scheduler)


def test_retraction_mid_prompt_neither_repeats_nor_loses_entries(
    hf_model, encode, default_model_dir: Path
) -> None:
    # The pool holds both prompts and little more: the decoding request grows into the
    # room the newer scoring request is prefilling into, which gets retracted (its KV
    # stays cached) and resumes later from the first position it had not scored.
    decoder = make_req("decoder", encode(SYSTEM * 2), temperature=0.0, max_new_tokens=40)
    decoder.params.ignore_eos = True
    prompt = encode(TABLE)[:200]
    scorer = scoring_req("scorer", prompt, 5)
    scheduler = make_scheduler(default_model_dir, kv_tokens=320, max_num_batched_tokens=16)
    rows = run_collecting_rows(scheduler, {0: [decoder], 2: [scorer]})
    assert scorer.num_retractions >= 1
    assert_matches_hf(hf_model, prompt, 5, prompt_entries(rows["scorer"]))
    assert_kv_returns_to_pool(scheduler)


def test_start_past_the_prompt_is_refused_by_name(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir)
    with pytest.raises(InvalidArgumentError) as err:
        scheduler.add_request(scoring_req("far", [0, 5, 6], 3))
    assert err.value.field == "logprob_start_len"
    bad_top = scoring_req("top", [0, 5, 6], 0)
    bad_top.prompt_logprobs = PromptLogprobState.create([0, 5, 6], 0, 21)
    with pytest.raises(InvalidArgumentError) as err:
        scheduler.add_request(bad_top)
    assert err.value.field == "prompt_top_logprobs_num"
    assert not scheduler.has_work


def test_score_rows_in_passes_equals_one_full_log_softmax() -> None:
    # More rows than one LM-head pass: the passes must stitch together exactly.
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(ROWS_PER_PASS + 37, 16, generator=gen)
    targets = torch.randint(0, 50, (hidden.shape[0],), generator=gen).tolist()
    got = score_rows(hidden, head, targets, 3)
    with torch.no_grad():
        ref = torch.log_softmax(head(hidden), dim=-1)
    assert [e.token_id for e in got] == targets
    for row, entry, target in zip(ref, got, targets, strict=True):
        assert entry.logprob == pytest.approx(float(row[target]), abs=1e-6)
        assert entry.rank == int((row > row[target]).sum()) + 1
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
