"""Pooling: last / mean / cls of the final-norm hidden states, against HF transformers.

The reference is HF's own float32 forward of the same checkpoint
(``output_hidden_states=True``, ``hidden_states[-1]``: checked here to be after the final
norm), pooled the same way and L2-normalised. Ours runs through the scheduler core in
float32: ragged prompts of every method in one batch beside a generating request, prompts
longer than a prefill chunk, a prompt partly in the prefix cache, and a retraction in the
middle of a prompt. The span arithmetic itself is checked on synthetic rows against a
direct pooling, for every chunking of a prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.common.errors import InvalidArgumentError
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import Req, SessionParams
from services.scheduler.model_executor.pooling import (
    POOLING_METHODS,
    PoolingMethod,
    PoolingState,
    plan_pool_spans,
    pool_rows,
    record_pool_spans,
)
from tests.scheduler.factories import (
    assert_kv_returns_to_pool,
    make_req,
    make_scheduler,
    run_collecting_rows,
)

ATOL = 1e-4  # float32 against float32: observed ~1e-6 on unit vectors of 256 entries


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def hf_pooled(model: PreTrainedModel, prompt: list[int], method: PoolingMethod) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    rows = {"last": hidden[-1:], "cls": hidden[:1], "mean": hidden}[method]
    return torch.nn.functional.normalize(rows.mean(dim=0), dim=0)


def pooling_req(rid: str, prompt: list[int], method: PoolingMethod, normalize: bool = True) -> Req:
    req = make_req(rid, prompt, max_new_tokens=0)
    req.pooling = PoolingState(method, normalize)
    return req


def prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [0, *torch.randint(2, 120_000, (length - 1,), generator=gen).tolist()]


def only_vector(rows: list[OutputRow]) -> torch.Tensor:
    """A pooling request's one row: finished (stop), nothing sampled, its vector."""
    assert len(rows) == 1
    row = rows[0]
    assert row.finish is not None and row.finish.kind == "stop"
    assert row.new_token_ids == () and row.num_output_tokens == 0
    return torch.tensor(row.embedding)


def test_hf_last_hidden_state_is_after_the_final_norm(hf_model: PreTrainedModel) -> None:
    ids = torch.tensor([prompt(1, 9)])
    with torch.no_grad():
        out = hf_model(ids, output_hidden_states=True)
        before_norm = hf_model.model(ids).last_hidden_state
    torch.testing.assert_close(out.hidden_states[-1], before_norm, atol=0, rtol=0)
    assert len(out.hidden_states) == hf_model.config.num_hidden_layers + 1


@pytest.mark.parametrize("method", POOLING_METHODS)
@pytest.mark.parametrize("chunks", [[7], [1, 6], [3, 3, 1], [2, 1, 1, 3]])
def test_spans_over_any_chunking_pool_what_one_pass_does(
    method: PoolingMethod, chunks: list[int]
) -> None:
    # Three ragged requests share the first step (the short ones whole), so a wrong
    # offset would read another request's rows; the long one goes on in later chunks.
    gen = torch.Generator().manual_seed(0)
    lengths = [sum(chunks), 3, 1]
    states = [torch.randn(n, 16, generator=gen, dtype=torch.float64) for n in lengths]
    reqs = [_Pooled(list(range(n)), PoolingState(method, normalize=False)) for n in lengths]
    done = [0, 0, 0]
    for k, chunk in enumerate(chunks):
        sizes = [chunk, 3, 1] if k == 0 else [chunk, 0, 0]
        hidden = torch.cat([s[d : d + n] for s, d, n in zip(states, done, sizes, strict=True)])
        spans = plan_pool_spans(reqs, done, [[0] * n for n in sizes])
        starts = [0, sizes[0], sizes[0] + sizes[1]]
        record_pool_spans(reqs, spans, pool_rows(hidden, starts, spans))
        done = [d + n for d, n in zip(done, sizes, strict=True)]
    for req, rows in zip(reqs, states, strict=True):
        want = {"last": rows[-1:], "cls": rows[:1], "mean": rows}[method].mean(dim=0)
        assert req.pooling is not None
        got = torch.tensor(req.pooling.result(len(rows)), dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


class _Pooled:
    def __init__(self, input_ids: list[int], pooling: PoolingState) -> None:
        self.input_ids = input_ids
        self.pooling = pooling


def test_ragged_rows_of_every_method_in_one_batch_match_hf(
    hf_model: PreTrainedModel, default_model_dir: Path
) -> None:
    # A chunk of 48 tokens a step: the 100-token prompts take three steps, sharing them
    # with the short ones and a generating request; every vector must be HF's.
    scheduler = make_scheduler(default_model_dir, max_num_batched_tokens=48)
    prompts = {"long": prompt(2, 100), "short": prompt(3, 5), "one": prompt(4, 1)}
    reqs = [
        pooling_req(f"{name}-{method}", ids, method)
        for name, ids in prompts.items()
        for method in POOLING_METHODS
    ]
    writer = make_req("writer", prompt(5, 20), temperature=0.0, max_new_tokens=6)
    writer.params.ignore_eos = True
    rows = run_collecting_rows(scheduler, {0: [writer, *reqs[:5]], 1: reqs[5:]})
    for name, ids in prompts.items():
        for method in POOLING_METHODS:
            got = only_vector(rows[f"{name}-{method}"])
            torch.testing.assert_close(got, hf_pooled(hf_model, ids, method), atol=ATOL, rtol=0)
            assert abs(float(got.norm()) - 1.0) < 1e-5
    assert sum(len(r.new_token_ids) for r in rows["writer"]) == 6
    assert_kv_returns_to_pool(scheduler)


def test_unnormalised_vector_is_the_pooled_state(
    hf_model: PreTrainedModel, default_model_dir: Path
) -> None:
    ids = prompt(6, 30)
    scheduler = make_scheduler(default_model_dir, max_num_batched_tokens=16)
    rows = run_collecting_rows(scheduler, {0: [pooling_req("raw", ids, "mean", normalize=False)]})
    with torch.no_grad():
        hidden = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(only_vector(rows["raw"]), hidden.mean(dim=0), atol=ATOL, rtol=0)


def test_prefix_cache_serves_last_and_never_the_rows_mean_and_cls_need(
    hf_model: PreTrainedModel, default_model_dir: Path
) -> None:
    shared = prompt(7, 40)
    full = [*shared, *prompt(8, 20)[1:]]
    scheduler = make_scheduler(default_model_dir, max_num_batched_tokens=32)
    run_collecting_rows(
        scheduler, {0: [make_req("first", shared, temperature=0.0, max_new_tokens=1)]}
    )
    reqs = {m: pooling_req(m, full, m) for m in POOLING_METHODS}
    rows = run_collecting_rows(scheduler, {0: list(reqs.values())})
    assert reqs["last"].num_cached_tokens >= len(shared) - 1
    assert reqs["mean"].num_cached_tokens == 0 and reqs["cls"].num_cached_tokens == 0
    for method in POOLING_METHODS:
        want = hf_pooled(hf_model, full, method)
        torch.testing.assert_close(only_vector(rows[method]), want, atol=ATOL, rtol=0)
    assert_kv_returns_to_pool(scheduler)


def test_mean_survives_a_retraction_mid_prompt(
    hf_model: PreTrainedModel, default_model_dir: Path
) -> None:
    # As in the prompt-logprob test: the decoding request grows into the room the newer
    # pooling request is prefilling into, which is retracted and resumes where it was.
    decoder = make_req("decoder", prompt(9, 120), temperature=0.0, max_new_tokens=40)
    decoder.params.ignore_eos = True
    ids = prompt(10, 200)
    pooled = pooling_req("pooled", ids, "mean")
    scheduler = make_scheduler(default_model_dir, kv_tokens=320, max_num_batched_tokens=16)
    rows = run_collecting_rows(scheduler, {0: [decoder], 2: [pooled]})
    assert pooled.num_retractions >= 1
    want = hf_pooled(hf_model, ids, "mean")
    torch.testing.assert_close(only_vector(rows["pooled"]), want, atol=ATOL, rtol=0)
    assert_kv_returns_to_pool(scheduler)


def test_pooling_requests_are_refused_by_name(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir)
    cases = {
        "max_new_tokens": make_req("gen", [0, 5], max_new_tokens=3),
        "session_params": make_req("sess", [0, 5], max_new_tokens=0),
        "logprob": make_req("lp", [0, 5], max_new_tokens=0),
    }
    cases["session_params"].session = SessionParams("s")
    cases["logprob"].return_logprob = True
    for field, req in cases.items():
        req.pooling = PoolingState("last")
        with pytest.raises(InvalidArgumentError) as err:
            scheduler.validate(req)
        assert err.value.field == field
    # No output token: a pooling prompt may fill the whole context, a generating one not.
    context = scheduler.limits.context_length
    scheduler.validate(pooling_req("full", [0] * context, "last"))
    with pytest.raises(InvalidArgumentError):
        scheduler.validate(make_req("full-gen", [0] * context, max_new_tokens=1))


def test_a_pooling_runner_serves_nothing_else(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir, runner="pooling")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError) as err:
        scheduler.add_request(make_req("chat", [0, 5, 6], max_new_tokens=4))
    assert err.value.field == "pooling" and "--runner pooling" in err.value.message
    rows = run_collecting_rows(scheduler, {0: [pooling_req("embed", [0, 5, 6], "last")]})
    assert len(only_vector(rows["embed"])) == scheduler.limits.hidden_size == 256
