"""The scheduler core over the real default model: request lifecycle, KV accounting,
retraction, prefix sharing between n choices, priorities and sampling options."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import AlreadyExistsError, InvalidArgumentError
from services.common.tokenizer import load_tokenizer
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import Scheduler
from tests.scheduler.factories import (
    assert_kv_conserved,
    assert_kv_returns_to_pool,
    make_req,
    make_scheduler,
    run_to_completion,
)

EOS = 1  # the default model's eos_token_id


def prompt(seed: int, length: int) -> list[int]:
    """A deterministic BOS-led prompt of ordinary token ids."""
    return [0, *[(seed * 7919 + i * 104729) % 30000 + 1000 for i in range(length - 1)]]


@pytest.fixture
def scheduler(default_model_dir: Path) -> Scheduler:
    return make_scheduler(default_model_dir)


# ---- lifecycle and KV accounting ----------------------------------------------------


def test_normal_finish_returns_kv_to_the_pool(scheduler: Scheduler) -> None:
    reqs = [make_req(f"r{i}", prompt(i, 5 + 9 * i), max_new_tokens=6) for i in range(3)]
    tokens = run_to_completion(scheduler, {0: reqs})
    for req in reqs:
        assert len(tokens[req.rid]) == 6
        assert req.finish is not None and req.finish.kind == "length"
    assert_kv_returns_to_pool(scheduler)


def test_stop_string_ends_the_request_and_returns_kv(
    default_model_dir: Path, scheduler: Scheduler
) -> None:
    tokenizer = load_tokenizer(default_model_dir)
    free_run = run_to_completion(
        scheduler, {0: [make_req("free", prompt(1, 12), temperature=0.0, max_new_tokens=12)]}
    )["free"]
    k = next(i for i in range(3, 12) if tokenizer.decode(free_run[i : i + 1]).strip())
    stop = tokenizer.decode(free_run[k : k + 1]).strip()
    req = make_req("stop", prompt(1, 12), temperature=0.0, max_new_tokens=12, stop=[stop])
    got = run_to_completion(scheduler, {0: [req]})["stop"]
    assert req.finish is not None and req.finish.kind == "stop" and req.finish.matched == stop
    assert got == free_run[: len(got)] and len(got) <= k + 1
    assert stop in tokenizer.decode(got)
    assert_kv_returns_to_pool(scheduler)


def test_abort_while_waiting(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir, max_running_requests=1)
    first = make_req("first", prompt(1, 8), max_new_tokens=4)
    queued = make_req("queued", prompt(2, 8), max_new_tokens=4)
    scheduler.add_request(first)
    scheduler.add_request(queued)
    scheduler.step()
    assert len(scheduler.waiting) == 1
    assert scheduler.abort("queued", "client went away")
    assert not scheduler.abort("queued")  # idempotent
    assert not scheduler.abort("never-seen")  # unknown rid: no-op
    rows = scheduler.step()
    final = [r for r in rows if r.rid == "queued"]
    assert len(final) == 1 and final[0].new_token_ids == ()
    assert final[0].finish is not None and final[0].finish.kind == "abort"
    assert final[0].finish.message == "client went away"
    tokens = run_to_completion(scheduler)
    assert "queued" not in tokens and len(first.output_ids) == 4 and not queued.output_ids
    assert_kv_returns_to_pool(scheduler)


def test_abort_while_running_frees_kv_at_once(scheduler: Scheduler) -> None:
    scheduler.add_request(make_req("a", prompt(3, 20), max_new_tokens=50))
    scheduler.add_request(make_req("b", prompt(4, 20), max_new_tokens=3))
    for _ in range(3):
        scheduler.step()
    assert scheduler.abort("a")
    assert not scheduler.abort("a")
    assert scheduler.kv.tree is not None and scheduler.kv.tree.num_locked == 0  # b finished
    assert scheduler.kv.num_free + scheduler.kv.num_evictable == scheduler.kv_pool.num_tokens
    rows = scheduler.step()
    assert [(r.rid, r.finish.kind) for r in rows if r.finish] == [("a", "abort")]
    assert not scheduler.has_work
    assert_kv_returns_to_pool(scheduler)


def test_a_request_that_outgrows_the_whole_pool_ends_with_length(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir, kv_tokens=24)
    req = make_req("big", prompt(5, 10), max_new_tokens=100, ignore_eos=True)
    tokens = run_to_completion(scheduler, {0: [req]})
    assert req.finish is not None and req.finish.kind == "length"
    assert len(tokens["big"]) == 24 - 10 + 1  # the last sampled token needs no KV
    assert_kv_returns_to_pool(scheduler)


def test_duplicate_rid_is_refused_while_in_flight(scheduler: Scheduler) -> None:
    scheduler.add_request(make_req("dup", prompt(6, 6), max_new_tokens=2))
    with pytest.raises(AlreadyExistsError):
        scheduler.add_request(make_req("dup", prompt(7, 6), max_new_tokens=2))
    run_to_completion(scheduler)
    scheduler.add_request(make_req("dup", prompt(7, 6), max_new_tokens=2))  # finished: reusable
    run_to_completion(scheduler)


@pytest.mark.parametrize(
    ("input_ids", "params", "field"),
    [
        ([], {}, "prompt"),
        ([0, 129_280], {}, "prompt"),
        ([0] * 5000, {}, "prompt"),
        ([0, 5], {"logit_bias": {200_000: 1.0}}, "logit_bias"),
        ([0, 5], {"temperature": -1.0}, "temperature"),
    ],
    ids=["empty", "out-of-vocab", "too-long", "bias-id", "temperature"],
)
def test_bad_requests_are_refused_naming_the_field(
    scheduler: Scheduler, input_ids: list[int], params: dict, field: str
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        scheduler.add_request(make_req("bad", input_ids, **params))
    assert info.value.field == field
    assert not scheduler.reqs and not len(scheduler.waiting)


# ---- retraction -----------------------------------------------------------------------


def retraction_workload() -> dict[int, list]:
    greedy = [
        make_req(f"g{i}", prompt(10 + i, 14 + 5 * i), temperature=0.0, max_new_tokens=12)
        for i in range(3)
    ]
    seeded = make_req("s", prompt(20, 16), temperature=0.9, seed=77, max_new_tokens=12)
    return {0: greedy[:2], 1: [seeded], 3: greedy[2:]}


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cached", "recomputed"])
def test_retract_and_resume_gives_identical_tokens(
    default_model_dir: Path, prefix_cache: bool
) -> None:
    roomy = make_scheduler(default_model_dir, enable_prefix_cache=prefix_cache)
    expected = run_to_completion(roomy, retraction_workload())
    assert roomy.stats.num_retractions == 0
    # Together they need ~115 slots at the end; each alone fits in 50.
    tight = make_scheduler(default_model_dir, kv_tokens=50, enable_prefix_cache=prefix_cache)
    got = run_to_completion(
        tight, retraction_workload(), after_step=lambda _: assert_kv_conserved(tight)
    )
    assert tight.stats.num_retractions > 0
    assert got == expected
    assert_kv_returns_to_pool(tight)


# ---- prefix sharing -------------------------------------------------------------------


def used_kv(scheduler: Scheduler) -> int:
    """Slots holding KV that someone needs: neither free nor evictable cache."""
    kv = scheduler.kv
    return scheduler.kv_pool.num_tokens - kv.num_free - kv.num_evictable


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["shared", "unshared"])
def test_n_choices_share_the_prompt_kv(default_model_dir: Path, prefix_cache: bool) -> None:
    """The frontend fans n=4 out as rids <rid>-<i> with one prompt and seeds seed+i."""
    scheduler = make_scheduler(default_model_dir, enable_prefix_cache=prefix_cache)
    shared_prompt, n, new = prompt(30, 200), 4, 5
    choices = [
        make_req(f"c-{i}", shared_prompt, temperature=1.0, seed=100 + i, max_new_tokens=new)
        for i in range(n)
    ]
    peak = 0

    def track(_: list[OutputRow]) -> None:
        nonlocal peak
        peak = max(peak, used_kv(scheduler))

    tokens = run_to_completion(scheduler, {0: choices}, after_step=track)
    assert all(len(tokens[c.rid]) == new for c in choices)
    if prefix_cache:
        assert peak <= len(shared_prompt) + n * (new + 1)
        assert [c.num_cached_tokens for c in choices] == [0] + [len(shared_prompt) - 1] * (n - 1)
    else:
        assert peak >= n * len(shared_prompt)
        assert all(c.num_cached_tokens == 0 for c in choices)
    assert_kv_returns_to_pool(scheduler)


def test_shared_choices_sample_like_unshared_ones(default_model_dir: Path) -> None:
    def run(prefix_cache: bool) -> dict[str, list[int]]:
        scheduler = make_scheduler(default_model_dir, enable_prefix_cache=prefix_cache)
        reqs = [
            make_req(f"c-{i}", prompt(31, 40), temperature=1.0, seed=5 + i, max_new_tokens=6)
            for i in range(3)
        ]
        return run_to_completion(scheduler, {0: reqs})

    assert run(True) == run(False)


def test_concurrent_prompts_with_a_common_prefix_keep_one_cached_copy(
    scheduler: Scheduler,
) -> None:
    """Both compute the common prefix in the same step; on insertion the second one's
    copy is freed and it switches to the cached slots, so the tree holds it once."""
    common = prompt(90, 100)
    prompts = {"a": common + prompt(91, 20)[1:], "b": common + prompt(92, 30)[1:]}
    new = 4

    def reqs() -> list[Req]:
        return [
            make_req(rid, ids, temperature=0.0, max_new_tokens=new) for rid, ids in prompts.items()
        ]

    together = run_to_completion(
        scheduler, {0: reqs()}, after_step=lambda _: assert_kv_conserved(scheduler)
    )
    unique = sum(map(len, prompts.values())) - len(common) + 2 * (new - 1)
    assert scheduler.kv.num_cached == unique
    assert_kv_returns_to_pool(scheduler)
    one_at_a_time = {r.rid: run_to_completion(scheduler, {0: [r]})[r.rid] for r in reqs()}
    assert together == one_at_a_time


# ---- ordering and sampling options ----------------------------------------------------


def test_priority_orders_the_waiting_queue(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir, max_running_requests=1)
    for rid, priority in [("low", 0), ("mid", 1), ("high", 5), ("mid2", 1)]:
        req = make_req(rid, prompt(40, 6), max_new_tokens=2)
        req.priority = priority
        scheduler.add_request(req)
    order: list[str] = []

    def record_finishes(rows: list[OutputRow]) -> None:
        order.extend(r.rid for r in rows if r.finish)

    run_to_completion(scheduler, after_step=record_finishes)
    assert order == ["high", "mid", "mid2", "low"]


def test_seeded_sampling_is_independent_of_the_batch(default_model_dir: Path) -> None:
    def seeded(seed: int = 4242) -> Req:
        params = dict(temperature=1.0, seed=seed, max_new_tokens=8)
        return make_req("seeded", prompt(50, 12), **params)

    def run(arrivals: dict[int, list[Req]]) -> list[int]:
        return run_to_completion(make_scheduler(default_model_dir), arrivals)["seeded"]

    alone = run({0: [seeded()]})
    crowd = {
        0: [make_req("greedy", prompt(51, 30), temperature=0.0, max_new_tokens=8)],
        1: [make_req("other", prompt(52, 9), temperature=1.0, max_new_tokens=8), seeded()],
        3: [make_req("late", prompt(53, 50), temperature=0.7, seed=1, max_new_tokens=4)],
    }
    assert run(crowd) == alone
    assert run({0: [seeded(4243)]}) != alone


def test_eos_options_under_a_forced_eos(scheduler: Scheduler) -> None:
    """logit_bias makes EOS the certain choice; min_tokens, ignore_eos and stop ids steer it."""
    force = {EOS: 100.0}
    plain = make_req("plain", prompt(60, 8), logit_bias=force, max_new_tokens=5)
    minimum = make_req("min", prompt(60, 8), logit_bias=force, min_new_tokens=3, max_new_tokens=5)
    ignore = make_req("ignore", prompt(60, 8), logit_bias=force, ignore_eos=True, max_new_tokens=3)
    tokens = run_to_completion(scheduler, {0: [plain, minimum, ignore]})
    assert tokens["plain"] == [EOS] and plain.finish.matched == EOS
    assert (
        EOS not in tokens["min"][:3]
        and tokens["min"][3:] == [EOS]
        and minimum.finish.kind == "stop"
    )
    assert tokens["ignore"] == [EOS] * 3 and ignore.finish.kind == "length"
    assert_kv_returns_to_pool(scheduler)


def test_stop_token_ids_end_the_request(scheduler: Scheduler) -> None:
    free_run = run_to_completion(
        scheduler, {0: [make_req("free", prompt(70, 10), temperature=0.0, max_new_tokens=10)]}
    )["free"]
    k = next(i for i in range(2, 10) if free_run[i] not in free_run[:i])
    params = dict(temperature=0.0, max_new_tokens=10, stop_token_ids=[free_run[k]])
    req = make_req("stop", prompt(70, 10), **params)
    assert run_to_completion(scheduler, {0: [req]})["stop"] == free_run[: k + 1]
    assert req.finish.kind == "stop" and req.finish.matched == free_run[k]


def test_rows_carry_logprobs_of_the_sampled_tokens(scheduler: Scheduler) -> None:
    req = make_req("lp", prompt(80, 10), temperature=0.8, seed=3, max_new_tokens=4)
    req.return_logprob, req.top_logprobs_num = True, 3
    rows: list[OutputRow] = []
    run_to_completion(scheduler, {0: [req]}, after_step=rows.extend)
    entries = [e for r in rows for e in r.logprobs]
    assert [e[0] for e in entries] == req.output_ids
    for _, logprob, top in entries:
        assert logprob <= 0 and len(top) == 3
        assert top[0][1] >= logprob and [v for _, v in top] == sorted(
            [v for _, v in top], reverse=True
        )
