"""Grammar-constrained decoding in the scheduler core, over the real default model: the
bitmask reaches the logits exactly, outputs match their grammar and end with ``stop``,
and retraction, abort, n choices and mixed batches keep every matcher right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xgrammar

from services.common.grammar import GrammarError
from services.common.sampling_params import GrammarSpec
from services.common.tokenizer import load_tokenizer
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.sampling.grammar import GrammarMasker, NextTokenMask, tokenizer_info
from services.scheduler.sampling.sampler import _dense_candidates
from tests.scheduler.factories import (
    assert_kv_conserved,
    assert_kv_returns_to_pool,
    make_req,
    make_scheduler,
    run_to_completion,
)
from tests.structured_cases import COLOR, PERSON, PRICE, Case

EOS = 1
VOCAB = 129_280


def prompt(seed: int, length: int = 12) -> list[int]:
    return [0, *[(seed * 7919 + i * 104729) % 30000 + 1000 for i in range(length - 1)]]


def grammar_req(rid: str, case: Case, seed: int, **params: object) -> Req:
    defaults = {"max_new_tokens": 200, "stop_token_ids": [EOS], "seed": seed, case.kind: case.text}
    return make_req(rid, prompt(seed), **{**defaults, **params})


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return load_tokenizer(default_model_dir)


@pytest.fixture
def scheduler(default_model_dir: Path) -> Scheduler:
    return make_scheduler(default_model_dir, kv_tokens=8192)


def text_of(tokenizer, req: Req) -> str:
    return tokenizer.decode(req.output_ids, skip_special_tokens=True)


def assert_matches(tokenizer, req: Req, case: Case) -> None:
    """Finished with ``stop`` on EOS (the grammar's end), and the text matches."""
    assert req.finish is not None and req.finish.kind == "stop", (
        req.finish,
        text_of(tokenizer, req),
    )
    assert req.output_ids[-1] == EOS and req.finish.matched == EOS
    case.check(text_of(tokenizer, req))


# ---- the mask itself ---------------------------------------------------------------


@pytest.mark.parametrize("additive", [True, False], ids=["additive", "xgrammar-kernel"])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3]], ids=["every-row", "some-rows"])
def test_bitmask_sets_exactly_the_disallowed_tokens_to_minus_inf(
    rows: list[int], additive: bool
) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=generator)
    bits = torch.randint(-(2**31), 2**31 - 1, (len(rows), VOCAB // 32), generator=generator)
    bitmask = bits.to(torch.int32)
    bitmask[-1] = 0
    bitmask[-1, 3] = 0b101  # only tokens 96 and 98
    expected = logits.clone()
    full = torch.full((4, VOCAB // 32), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(expected, full, indices=rows)
    masker = GrammarMasker()
    mask = NextTokenMask(bitmask, masker.expand(bitmask, VOCAB) if additive else None)
    masker.apply(logits, mask, rows)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[rows[-1]]).nonzero().flatten().tolist() == [96, 98]


def test_a_batch_without_grammars_is_left_alone(scheduler: Scheduler) -> None:
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    scheduler.sampler.processor.grammar_mask(logits, [make_req("a", [0, 5]), make_req("b", [0])])
    assert torch.equal(logits, before)


# ---- compile cache -----------------------------------------------------------------


def test_each_grammar_compiles_once_and_an_invalid_one_fails(scheduler: Scheduler) -> None:
    spec = GrammarSpec("regex", PRICE.text)
    first = scheduler.grammars.get(spec)
    assert scheduler.grammars.get(GrammarSpec("regex", PRICE.text)) is first
    first.result(timeout=60)
    bad = scheduler.grammars.get(GrammarSpec("json_schema", '{"type": "nope"}'))
    with pytest.raises(GrammarError, match="nope"):
        bad.result(timeout=60)


# ---- decoding --------------------------------------------------------------------------


@pytest.mark.parametrize("case", [PERSON, PRICE, COLOR], ids=lambda c: c.name)
def test_outputs_match_their_grammar_sampled_and_greedy(
    scheduler: Scheduler, tokenizer, case: Case
) -> None:
    reqs = [grammar_req(f"s{seed}", case, seed) for seed in range(4)]
    reqs.append(grammar_req("greedy", case, 9, temperature=0.0))
    reqs.append(grammar_req("top", case, 10, top_k=20, top_p=0.9, min_p=0.01))
    run_to_completion(scheduler, {0: reqs})
    for req in reqs:
        assert_matches(tokenizer, req, case)
        assert req.grammar is not None and req.grammar.num_accepted == len(req.output_ids)
    assert_kv_returns_to_pool(scheduler)


def test_unconstrained_rows_sample_as_without_grammar_neighbours(default_model_dir: Path) -> None:
    def plain() -> list[Req]:
        return [make_req(f"p{i}", prompt(40 + i), seed=i, max_new_tokens=10) for i in range(2)]

    alone = make_scheduler(default_model_dir)
    expected = run_to_completion(alone, {0: plain()})
    mixed = make_scheduler(default_model_dir)
    got = run_to_completion(mixed, {0: [*plain(), grammar_req("g", PRICE, 3)]})
    assert {rid: got[rid] for rid in expected} == expected


def test_the_choices_of_one_request_share_a_grammar_but_not_a_matcher(
    scheduler: Scheduler, tokenizer
) -> None:
    choices = [grammar_req(f"c-{i}", PRICE, seed=100 + i) for i in range(3)]
    for req in choices:
        req.input_ids = prompt(5)
    run_to_completion(scheduler, {0: choices})
    assert len({id(r.grammar.future) for r in choices}) == 1
    assert len({id(r.grammar.matcher) for r in choices}) == 3
    for req in choices:
        assert_matches(tokenizer, req, PRICE)


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cached", "recomputed"])
def test_retract_and_resume_keep_the_matcher(
    default_model_dir: Path, tokenizer, prefix_cache: bool
) -> None:
    """The price regex (8-10 tokens an answer, not the JSON schema's ~140: a quarter of
    the steps) in a 40-token pool: the three 12-token prompts fit, so a request is
    retracted only once outputs grow, i.e. with its matcher part-way through."""

    def workload() -> dict[int, list[Req]]:
        reqs = [grammar_req(f"r{i}", PRICE, seed=i) for i in range(3)]
        return {0: reqs[:2], 2: reqs[2:]}

    roomy = make_scheduler(default_model_dir, enable_prefix_cache=prefix_cache)
    expected = run_to_completion(roomy, workload())
    tight = make_scheduler(default_model_dir, kv_tokens=40, enable_prefix_cache=prefix_cache)
    reqs = workload()
    retractions_seen = {req.rid: 0 for req in [*reqs[0], *reqs[2]]}
    accepted_when_retracted: list[int] = []

    def check(_: object) -> None:
        assert_kv_conserved(tight)
        for req in [*reqs[0], *reqs[2]]:
            if req.num_retractions > retractions_seen[req.rid]:
                retractions_seen[req.rid] = req.num_retractions
                accepted_when_retracted.append(req.grammar.num_accepted)

    got = run_to_completion(tight, reqs, after_step=check)
    assert tight.stats.num_retractions == len(accepted_when_retracted) > 0
    assert all(accepted > 0 for accepted in accepted_when_retracted)
    assert got == expected
    for req in [*reqs[0], *reqs[2]]:
        assert_matches(tokenizer, req, PRICE)


def test_abort_while_compiling_and_while_decoding(scheduler: Scheduler) -> None:
    compiling = grammar_req("compiling", PERSON, 1, json_schema='{"type": "array"}')
    decoding = grammar_req("decoding", PERSON, 2)
    scheduler.add_request(compiling)
    scheduler.abort("compiling")
    scheduler.add_request(decoding)
    finished = []
    while not decoding.output_ids:
        finished += [r.rid for r in scheduler.step() if r.finish is not None]
    assert scheduler.abort("decoding")
    finished += [r.rid for r in scheduler.step() if r.finish is not None]
    assert finished == ["compiling", "decoding"]
    assert not scheduler.has_work and not scheduler._compiling
    assert_kv_returns_to_pool(scheduler)


def test_a_grammar_that_does_not_compile_ends_with_abort(scheduler: Scheduler) -> None:
    req = grammar_req("bad", PRICE, 1, regex="[a-")
    tokens = run_to_completion(scheduler, {0: [req]})
    assert tokens == {"bad": []}
    assert req.finish is not None and req.finish.kind == "abort"
    assert "invalid regex" in req.finish.message and "[" in req.finish.message


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(
    scheduler: Scheduler, tokenizer
) -> None:
    req = grammar_req("eos", COLOR, 4, ignore_eos=True, stop_token_ids=[])
    run_to_completion(scheduler, {0: [req]})
    assert_matches(tokenizer, req, COLOR)


def test_max_tokens_cuts_a_grammar_short_with_length(scheduler: Scheduler) -> None:
    req = grammar_req("short", PERSON, 1, max_new_tokens=3)
    run_to_completion(scheduler, {0: [req]})
    assert req.finish is not None and req.finish.kind == "length"
    assert len(req.output_ids) == 3


def test_sampled_rows_with_a_grammar_weigh_forbidden_tokens_exactly_zero() -> None:
    logits = torch.randn(2, VOCAB) * 8
    logits[:, 10:] = float("-inf")  # what a grammar mask leaves
    expected = torch.softmax(logits.double(), dim=-1).float()  # the allowed tokens' probs
    reqs = [make_req("a", [0]), make_req("b", [0])]
    for req in reqs:
        req.grammar = object()  # type: ignore[assignment]  # only its presence matters here
    weights = _dense_candidates(logits.clone(), reqs, [0, 1]).weights
    assert torch.equal(weights[:, 10:], torch.zeros(2, VOCAB - 10))
    torch.testing.assert_close(weights[:, :10], expected[:, :10], rtol=1e-5, atol=1e-30)


def test_a_prefetched_fill_is_used_only_for_the_rows_it_was_made_for(scheduler: Scheduler) -> None:
    reqs = [grammar_req("p0", PRICE, 1), grammar_req("p1", PERSON, 2)]
    for req in reqs:  # compiled first, so both join one prefill and neither can finish alone
        assert req.params.grammar is not None
        scheduler.grammars.get(req.params.grammar).result(timeout=60)
    for req in reqs:
        scheduler.add_request(req)
    while not all(r.output_ids for r in reqs):  # prefilled, one token each
        scheduler.step()
    assert not any(r.is_finished for r in reqs)
    logits = torch.randn(2, VOCAB)
    expected = logits.clone()
    GrammarMasker()(expected, reqs)  # filled on the spot
    masker = GrammarMasker()
    masker.prefetch(reqs, VOCAB, torch.device("cpu"))
    got = logits.clone()
    masker(got, reqs)
    assert torch.equal(got, expected)
    masker.prefetch(reqs, VOCAB, torch.device("cpu"))  # for both rows, used for one: rebuilt
    one = logits[1:].clone()
    masker(one, reqs[1:])
    assert torch.equal(one, expected[1:])


def test_schedulers_over_one_tokenizer_share_its_vocabulary_view(default_model_dir: Path) -> None:
    """Reading the 129k vocabulary is paid once per tokenizer and stop set, not per scheduler."""
    first = make_scheduler(default_model_dir).grammars
    second = make_scheduler(default_model_dir).grammars
    tokenizer = first._tokenizer
    shared = tokenizer_info(tokenizer, first.vocab_size, tuple(first.eos_token_ids))
    assert shared is tokenizer_info(tokenizer, second.vocab_size, tuple(second.eos_token_ids))
    assert shared is not tokenizer_info(tokenizer, first.vocab_size, (*first.eos_token_ids, 2))
