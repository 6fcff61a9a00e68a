"""Sampler and logits processor against references computed here, token by token."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from services.scheduler.core.req import Req
from services.scheduler.sampling.logits_processor import LogitsProcessor
from services.scheduler.sampling.row_argmax import argmax_rows
from services.scheduler.sampling.sampler import Candidates, Sampler, nucleus_mask
from tests.scheduler.factories import make_req

VOCAB = 12
EOS = 1


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def req_with_history(
    input_ids: list[int], output_ids: list[int], seed: int | None = None, **params: object
) -> Req:
    req = make_req("r", input_ids, seed=seed, **params)
    req.output_ids = list(output_ids)
    if seed is not None:
        req.generator = torch.Generator().manual_seed(seed)
    return req


# ---- references, one token at a time ---------------------------------------------


def reference_penalties(row: list[float], req: Req) -> list[float]:
    p = req.params
    out = []
    for token, logit in enumerate(row):
        count = req.output_ids.count(token)
        if token in req.input_ids or count:
            logit = logit / p.repetition_penalty if logit > 0 else logit * p.repetition_penalty
        logit -= p.frequency_penalty * count + p.presence_penalty * (1 if count else 0)
        out.append(logit)
    return out


def reference_distribution(
    row: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    """Temperature, keep the k largest logits, softmax, then the top-p nucleus and min-p."""
    scaled = [x / temperature for x in row]
    order = sorted(range(len(row)), key=lambda t: -scaled[t])
    kept = set(order[:top_k]) if top_k > 0 else set(order)
    total = sum(math.exp(scaled[t]) for t in kept)
    probs = {t: math.exp(scaled[t]) / total for t in kept}
    nucleus, mass = set(), 0.0
    for t in sorted(probs, key=lambda t: -probs[t]):
        if mass >= top_p:
            break
        nucleus.add(t)
        mass += probs[t]
    top = max(probs.values())
    final = [probs[t] if t in nucleus and probs[t] >= min_p * top else 0.0 for t in range(len(row))]
    norm = sum(final)
    return [x / norm for x in final]


# ---- logits processor ----------------------------------------------------------------

PENALTIES = {
    "frequency": {"frequency_penalty": 0.7},
    "presence": {"presence_penalty": 1.1},
    "repetition": {"repetition_penalty": 1.6},
    "negative_frequency": {"frequency_penalty": -0.5},
    "all": {"frequency_penalty": 0.4, "presence_penalty": -0.3, "repetition_penalty": 0.8},
}


@pytest.mark.parametrize("params", PENALTIES.values(), ids=PENALTIES.keys())
def test_penalties_match_reference(params: dict) -> None:
    logits = random_logits(2)
    penalised = req_with_history([2, 3, 9], [3, 3, 5, 7, 5, 3], **params)
    plain = req_with_history([2, 3, 9], [3, 5])
    expected = reference_penalties(logits[0].tolist(), penalised)
    processed = logits.clone()
    LogitsProcessor({EOS})(processed, [penalised, plain])
    assert processed[0].tolist() == pytest.approx(expected, abs=1e-5)
    assert torch.equal(processed[1], logits[1])  # a plain row in the same batch is untouched


def test_penalty_counts_follow_sampled_tokens_across_steps() -> None:
    processor = LogitsProcessor({EOS})
    req = req_with_history([4], [], frequency_penalty=1.0)
    for token in (6, 6, 2):
        processor(random_logits(1), [req])
        processor.record([req], [token])
        req.output_ids.append(token)
    logits = torch.zeros(1, VOCAB)
    processor(logits, [req])
    assert logits[0, 6] == -2.0 and logits[0, 2] == -1.0 and logits[0, 4] == 0.0


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    logits = random_logits(2)
    biased = req_with_history([2], [], logit_bias={4: 5.0, 7: -100.0})
    processed = logits.clone()
    LogitsProcessor({EOS})(processed, [req_with_history([2], []), biased])
    expected = logits[1].clone()
    expected[4] += 5.0
    expected[7] -= 100.0
    assert torch.equal(processed[0], logits[0])
    assert torch.allclose(processed[1], expected)


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    early = req_with_history([2], [5], min_new_tokens=3, stop_token_ids=[6])
    early_ignore_eos = req_with_history(
        [2], [5], min_new_tokens=3, stop_token_ids=[6], ignore_eos=True
    )
    reached = req_with_history([2], [5, 5, 5], min_new_tokens=3, stop_token_ids=[6])
    logits = random_logits(3)
    processed = logits.clone()
    LogitsProcessor({EOS})(processed, [early, early_ignore_eos, reached])
    inf = float("-inf")
    assert processed[0, EOS] == inf and processed[0, 6] == inf
    assert processed[1, EOS] == logits[1, EOS] and processed[1, 6] == inf
    assert torch.equal(processed[2], logits[2])
    others = [t for t in range(VOCAB) if t not in (EOS, 6)]
    assert torch.equal(processed[:2, others], logits[:2, others])


# ---- sampling ------------------------------------------------------------------------

DISTRIBUTIONS = {
    "temperature": dict(temperature=0.6, top_k=-1, top_p=1.0, min_p=0.0),
    "top_k": dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0),
    "top_p": dict(temperature=1.0, top_k=-1, top_p=0.7, min_p=0.0),
    "min_p": dict(temperature=1.3, top_k=-1, top_p=1.0, min_p=0.2),
    "top_k_min_p": dict(temperature=1.3, top_k=6, top_p=1.0, min_p=0.3),
    "combined": dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
}


def reference_for(row: torch.Tensor, params: dict) -> list[float]:
    """``reference_distribution`` for request params, defaults filled in; greedy: the argmax."""
    if params.get("temperature", 1.0) == 0.0:
        return [float(t == int(row.argmax())) for t in range(VOCAB)]
    defaults = dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)
    return reference_distribution(
        row.tolist(), **{k: params.get(k, v) for k, v in defaults.items()}
    )


def candidate_distribution(sampler: Sampler, logits: torch.Tensor, req: Req) -> Candidates:
    """The one candidate group a single sampled request draws from."""
    [group] = sampler.candidates(logits.clone(), [req])
    return group


def normalised(group: Candidates, row: int = 0) -> list[float]:
    weights = group.dense(VOCAB)[row]
    return (weights / weights.sum()).tolist()


def seeded_draws(sampler: Sampler, logits: torch.Tensor, params: dict, num: int) -> torch.Tensor:
    """Token counts [vocab] from ``num`` one-step requests seeded 0..num-1 (reproducible)."""
    vocab = logits.shape[-1]
    reqs = [req_with_history([2], [], seed=i, **params) for i in range(num)]
    tokens = sampler.sample(logits.expand(num, vocab).clone(), reqs).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def assert_goodness_of_fit(counts: torch.Tensor, expected: list[float]) -> None:
    """Chi-square over tokens with expected probability > 0 (those expecting fewer than 5
    draws pooled into one bin, as the test needs), and no draw where it is 0."""
    probs = torch.tensor(expected, dtype=torch.float64)
    assert torch.all(counts[probs == 0] == 0)
    expect = probs * counts.sum()
    is_big = expect >= 5
    observed = counts[is_big].tolist()
    wanted = expect[is_big].tolist()
    if float(expect[~is_big].sum()) > 0:
        observed.append(float(counts[~is_big].sum()))
        wanted.append(float(expect[~is_big].sum()))
    assert chisquare(observed, wanted).pvalue > 1e-4


@pytest.mark.parametrize("params", DISTRIBUTIONS.values(), ids=DISTRIBUTIONS.keys())
def test_sampling_distribution_matches_reference(params: dict) -> None:
    logits = random_logits(1, seed=3)
    group = candidate_distribution(Sampler(), logits, req_with_history([2], [], **params))
    expected = reference_distribution(logits[0].tolist(), **params)
    assert normalised(group) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("params", DISTRIBUTIONS.values(), ids=DISTRIBUTIONS.keys())
def test_draws_pass_a_chi_square_test_against_the_reference(params: dict) -> None:
    logits = random_logits(1, seed=3)
    counts = seeded_draws(Sampler(), logits, params, 20_000)
    assert_goodness_of_fit(counts, reference_distribution(logits[0].tolist(), **params))


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, min_p=0.05)])
def test_a_vocabulary_wide_row_draws_through_block_sums_exactly(params: dict) -> None:
    """Rows as wide as a real vocabulary take the two-stage inverse CDF (block sums, then
    one block): mass on block edges and in the padded last block lands where it should."""
    vocab = 1000  # wider than the scan threshold, and not a multiple of the block
    support = [0, 127, 128, 255, 256, 511, 640, 998, 999]
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, support] = torch.linspace(0.0, 2.5, len(support))
    probs = torch.softmax(logits[0].double() / params["temperature"], dim=0)
    if "min_p" in params:
        probs = torch.where(probs >= params["min_p"] * probs.max(), probs, 0.0)
    expected = (probs / probs.sum()).tolist()
    assert_goodness_of_fit(seeded_draws(Sampler(), logits, params, 20_000), expected)


NUCLEUS_SLACK = 1e-5
"""How near its top_p edge a token's preceding mass may sit and still go either way: float32
sums of 20,000 terms in any order differ by ~1e-6, and both the binned and the sorted mask
are such sums."""


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, by a full sort in float64: keep a token while the mass before it is
    below top_p. Also which tokens sit clear of the edge (by more than NUCLEUS_SLACK)."""
    values, order = probs.double().sort(descending=True)
    before = values.cumsum(0) - values
    keep = torch.zeros_like(probs, dtype=torch.bool)
    clear = torch.zeros_like(keep)
    keep[order] = before < top_p
    clear[order] = (before - top_p).abs() > NUCLEUS_SLACK
    return keep, clear


def assert_nucleus(got: torch.Tensor, probs: torch.Tensor, top_p: float) -> None:
    """Only tokens near the edge may go either way, and what is kept never ranks below what
    is dropped."""
    want, clear = sorted_nucleus(probs, top_p)
    assert torch.equal(got[clear], want[clear])
    if bool(got.any()) and bool((~got).any()):
        assert float(probs[got].min()) >= float(probs[~got].max())


@pytest.mark.parametrize("spread", [0.3, 1.0, 4.0], ids=["flat", "random-model", "peaked"])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_the_binned_nucleus_equals_the_sorted_one(spread: float, top_p: float) -> None:
    """Wide rows (a flat 20,000-token distribution like the random default model's) find
    their nucleus without a sort: the kept tokens are the sorted definition's."""
    logits = torch.randn(3, 20_000, generator=torch.Generator().manual_seed(5)) * spread
    probs = torch.softmax(logits, dim=-1)
    got = nucleus_mask(probs, torch.full((3, 1), top_p))
    for row in range(3):
        assert_nucleus(got[row], probs[row], top_p)


def test_the_binned_nucleus_with_tied_probabilities_keeps_as_many_as_a_sort() -> None:
    """bf16 logits tie often; which of equal tokens stays is arbitrary in both, how many
    (and so the mass) is not."""
    logits = (torch.randn(2, 5_000, generator=torch.Generator().manual_seed(9)) * 0.5).bfloat16()
    probs = torch.softmax(logits.float(), dim=-1)
    got = nucleus_mask(probs, torch.full((2, 1), 0.7))
    for row in range(2):
        want, _ = sorted_nucleus(probs[row], 0.7)
        assert int(got[row].sum()) == int(want.sum())
        assert float(probs[row][got[row]].sum()) == pytest.approx(float(probs[row][want].sum()))


@pytest.mark.parametrize("cap_offset", [-3, -1, 0, 1], ids=["cap<<n", "cap=n-1", "cap=n", "cap>n"])
def test_top_p_candidates_cover_the_nucleus_or_fall_back_to_a_full_sort(cap_offset: int) -> None:
    """A nucleus wider than the candidate cap (a flat distribution) is redone over the whole
    row; one that fits stays within the candidates, normalised over the whole vocabulary."""
    params = dict(temperature=1.0, top_k=-1, top_p=0.9, min_p=0.0)
    logits = random_logits(1, seed=3) / 3
    expected = reference_distribution(logits[0].tolist(), **params)
    nucleus = sum(p > 0 for p in expected)
    assert nucleus + cap_offset < VOCAB - 1  # the cap really cuts the vocabulary
    sampler = Sampler(candidate_cap=nucleus + cap_offset)
    group = candidate_distribution(sampler, logits, req_with_history([2], [], **params))
    is_full_sort = cap_offset < 0
    assert group.weights.shape[-1] == (VOCAB if is_full_sort else nucleus + cap_offset)
    assert normalised(group) == pytest.approx(expected, abs=1e-6)
    assert_goodness_of_fit(seeded_draws(sampler, logits, params, 20_000), expected)


def test_a_mixed_batch_draws_each_row_from_its_own_support() -> None:
    """Greedy, seeded, top-k, top-p (one sharing the top-k rows' candidate count, one
    falling back to a full sort), min-p and plain rows in one batch."""
    rows = {
        "greedy": dict(temperature=0.0),
        "seeded": dict(temperature=0.9, seed=7),
        "top_k": dict(temperature=1.0, top_k=4),
        "top_p": dict(temperature=1.0, top_p=0.5),
        "top_p_wide": dict(temperature=2.0, top_p=0.95),
        "top_k_top_p": dict(temperature=0.7, top_k=4, top_p=0.8, min_p=0.1),
        "min_p": dict(temperature=1.5, min_p=0.3),
        "plain": dict(temperature=1.0),
    }
    logits = random_logits(len(rows), seed=21) / 2
    expected = [reference_for(logits[row], params) for row, params in enumerate(rows.values())]
    sampler = Sampler(candidate_cap=4)
    reqs = [req_with_history([2], [], **params) for params in rows.values()]
    groups = sampler.candidates(logits.clone(), reqs)
    # plain rows over the vocabulary, the wide top-p row sorted, the others from 4 candidates
    assert [(g.rows, g.weights.shape[-1]) for g in groups] == [
        ([1, 6, 7], VOCAB),
        ([4], VOCAB),
        ([2, 3, 5], 4),
    ]
    for group in groups:
        for j, row in enumerate(group.rows):
            assert normalised(group, j) == pytest.approx(expected[row], abs=1e-6)
    support = [{t for t, p in enumerate(e) if p > 0} for e in expected]
    seeded = req_with_history([2], [], **rows["seeded"])
    seen: list[set[int]] = [set() for _ in rows]
    for _ in range(200):
        reqs = [req_with_history([2], [], **params) for params in rows.values()]
        reqs[1] = seeded
        for row, token in enumerate(sampler.sample(logits.clone(), reqs).token_ids):
            assert token in support[row], list(rows)[row]
            seen[row].add(token)
    assert all(len(s) > 1 for s in seen[1:])  # the sampled rows really sample


def test_draw_never_takes_a_zero_weight_token_at_the_float_edge() -> None:
    """u * total may round up to the total (simulated by u = 1), or a total may be 0: the
    row then takes its top token, never a removed one."""
    weights = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    most_likely = torch.tensor([2, 3])
    uniforms = torch.tensor([1.0, 0.5])
    dense = Candidates([0, 1], weights, None)
    assert dense.draw(uniforms, lambda: most_likely).tolist() == [2, 3]
    token_ids = torch.tensor([[7, 5, 6, 4], [3, 2, 1, 0]])
    sorted_weights = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    top = Candidates([0, 1], sorted_weights, token_ids).draw(uniforms, lambda: most_likely)
    assert top.tolist() == [7, 3]  # column 0 of sorted candidates is the row's top token


def test_draws_follow_the_distribution() -> None:
    """20,000 draws land on each token with its reference probability, and never on a
    token the filters removed."""
    params = DISTRIBUTIONS["combined"]
    logits = random_logits(1, seed=3)
    expected = torch.tensor(reference_distribution(logits[0].tolist(), **params))
    sampler = Sampler()
    rows = 4000
    reqs = [req_with_history([2], [], **params) for _ in range(rows)]
    counts = torch.zeros(VOCAB)
    for _ in range(5):
        tokens = sampler.sample(logits.expand(rows, VOCAB).clone(), reqs).token_ids
        counts += torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    freq = counts / counts.sum()
    assert float((freq - expected).abs().sum()) / 2 < 0.02  # total variation distance
    assert torch.all(counts[expected == 0] == 0)


def test_greedy_takes_argmax_after_penalties_and_bias() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.9
    plain = req_with_history([0], [], temperature=0.0)
    penalised = req_with_history([0], [3], temperature=0.0, presence_penalty=0.5)
    assert Sampler().sample(logits, [plain, penalised]).token_ids == [3, 4]


SEEDED_CASES = {
    # (the seeded row's params, what the other rows of the batch ask for)
    "temperature": (dict(temperature=1.0), [dict(temperature=1.0)]),
    # Other rows change which candidate groups exist (and a top-p row's candidate count is
    # shared with top-k rows of k = cap), never the seeded row's tokens.
    "top_k": (dict(top_k=5), [dict(top_k=3), dict(top_p=0.5), dict(temperature=0.0)]),
    "top_p": (dict(top_p=0.8), [dict(top_k=3), dict(top_p=0.5), dict(temperature=0.0)]),
}


@pytest.mark.parametrize("params, others", SEEDED_CASES.values(), ids=SEEDED_CASES.keys())
def test_seeded_draws_ignore_the_rest_of_the_batch(params: dict, others: list[dict]) -> None:
    logits = random_logits(4, seed=11) / 3  # flat enough that draws vary

    def draw(batch_rows: list[int], seeded_row: int) -> list[int]:
        sampler = Sampler(candidate_cap=3)
        seeded = req_with_history([2], [], seed=1234, **params)
        tokens = []
        for _ in range(20):
            reqs = [req_with_history([2], [], **others[j % len(others)]) for j in batch_rows]
            reqs[seeded_row] = seeded
            out = sampler.sample(logits[batch_rows].clone(), reqs)
            tokens.append(out.token_ids[seeded_row])
        return tokens

    alone = draw([0], 0)
    assert draw([1, 0, 2], 1) == alone
    assert draw([3, 2, 1, 0], 3) == alone
    assert len(set(alone)) > 1  # it really samples


def test_logprobs_are_the_raw_model_distribution() -> None:
    logits = random_logits(3, seed=5)
    reqs = [
        req_with_history([2], [2], temperature=0.5, top_k=2, frequency_penalty=1.5),
        req_with_history([2], [], temperature=0.0),
        req_with_history([2], [], temperature=1.0),
    ]
    reqs[0].return_logprob, reqs[0].top_logprobs_num = True, 4
    reqs[1].return_logprob = True
    out = Sampler().sample(logits.clone(), reqs)
    raw = torch.log_softmax(logits, dim=-1)
    for row in (0, 1):
        token, logprob, top = out.logprobs[row]
        assert token == out.token_ids[row]
        assert logprob == pytest.approx(float(raw[row, token]), abs=1e-6)
    _, _, top = out.logprobs[0]
    values, ids = raw[0].topk(4)
    assert [t for t, _ in top] == ids.tolist()
    assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.logprobs[1][2] == [] and out.logprobs[2] is None


# ---- argmax over long rows --------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    num_rows=st.integers(1, 5),
    width=st.integers(1, 2_000),
    levels=st.integers(1, 4),  # few distinct values: the maximum repeats, ties must go first
    seed=st.integers(0, 2**31 - 1),
)
def test_argmax_rows_is_torch_argmax(num_rows: int, width: int, levels: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, levels, (num_rows, width), generator=gen).float()
    values[0, torch.randint(0, width, (1,), generator=gen)] = -math.inf
    assert torch.equal(argmax_rows(values), values.argmax(dim=-1))
    dense = torch.randn(num_rows, width, generator=gen)
    assert torch.equal(argmax_rows(dense), dense.argmax(dim=-1))


def test_argmax_rows_on_a_vocabulary_row_with_the_maximum_in_the_ragged_tail() -> None:
    values = torch.zeros(3, 129_281)  # 1,010 full blocks of 128 and one entry
    values[0, -1] = 1.0  # only in the tail
    values[1, 129_279] = values[1, -1] = 1.0  # last full block first
    values[2, 5] = math.nan  # NaN counts as the maximum, as in torch.argmax
    assert argmax_rows(values).tolist() == [129_280, 129_279, 5]
    assert torch.equal(argmax_rows(values), values.argmax(dim=-1))


_BF16_SPECIALS = {  # bit patterns as int16: signed zeros, infinities and NaNs of both signs
    "+0": 0x0000,
    "-0": -0x8000,
    "+inf": 0x7F80,
    "-inf": -0x0080,
    "+nan": 0x7FC0,
    "-nan": -0x0040,
}


@settings(max_examples=80, deadline=None)
@given(
    num_rows=st.integers(1, 4),
    width=st.integers(512, 1_500),  # from 4 blocks of 128 up: the bit-pattern path
    levels=st.sampled_from([[1.0, 2.0], [-3.0, -1.0], [-1.0, 0.0], [0.5, 2.0, -2.0]]),
    special=st.sampled_from([None, *_BF16_SPECIALS]),
    seed=st.integers(0, 2**31 - 1),
)
def test_argmax_rows_of_bfloat16_is_torch_argmax(
    num_rows: int, width: int, levels: list[float], special: str | None, seed: int
) -> None:
    """Few distinct values (ties must go to the first), all-negative rows, signed zeros,
    infinities and NaNs of either sign: the int16 shortcut must agree everywhere."""
    gen = torch.Generator().manual_seed(seed)
    choice = torch.randint(0, len(levels), (num_rows, width), generator=gen)
    values = torch.tensor(levels)[choice].to(torch.bfloat16)
    if special is not None:
        bits = torch.tensor([_BF16_SPECIALS[special]], dtype=torch.int16)
        column = int(torch.randint(0, width, (1,), generator=gen))
        values[-1, column] = bits.view(torch.bfloat16)[0]
    assert torch.equal(argmax_rows(values), values.argmax(dim=-1))
    dense = torch.randn(num_rows, width, generator=gen).to(torch.bfloat16)
    assert torch.equal(argmax_rows(dense), dense.argmax(dim=-1))


def test_plain_greedy_rows_are_chosen_in_the_models_dtype_and_edited_rows_are_not() -> None:
    """A bfloat16 batch of plain greedy rows is argmaxed as is; a row with a logit bias
    (or logprobs) still goes through the float32 path, and both give the reference."""
    logits = (torch.randn(3, 2_000, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    plain = [make_req(f"p{i}", [2, 3], temperature=0.0) for i in range(3)]
    expected = logits.float().argmax(dim=-1).tolist()
    assert Sampler().sample(logits.clone(), plain).token_ids == expected
    biased = make_req("b", [2, 3], temperature=0.0, logit_bias={7: 1e4})
    out = Sampler().sample(logits.clone(), [plain[0], biased, plain[2]])
    assert out.token_ids == [expected[0], 7, expected[2]]
    with_logprobs = make_req("l", [2, 3], temperature=0.0)
    with_logprobs.return_logprob = True
    out = Sampler().sample(logits.clone(), [with_logprobs])
    assert out.token_ids == expected[:1] and out.logprobs[0] is not None
