"""One-line builders for a CPU scheduler core over the real default model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import Scheduler, SchedulerConfig
from services.scheduler.core.stop_checker import StopChecker
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.models.loader import load_model

_MODELS: dict[tuple, tuple] = {}
_TOKENIZERS: dict[str, object] = {}


def make_scheduler(
    model_dir: Path,
    *,
    kv_tokens: int = 4096,
    dtype: torch.dtype = torch.float32,
    load: dict[str, str | bool] | None = None,
    **config: int | bool,
) -> Scheduler:
    """``load``: more ``load_model`` options (``quantization``, ``batch_invariant``)."""
    load = load or {}
    key = (str(model_dir), dtype, *sorted(load.items()))
    if key not in _MODELS:  # loading is the slow part; model and tokenizer are read-only
        _MODELS[key] = load_model(model_dir, dtype, "cpu", **load)  # type: ignore[arg-type]
    model, model_config = _MODELS[key]
    pool = KVPool(
        kv_tokens, model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype
    )
    if str(model_dir) not in _TOKENIZERS:
        _TOKENIZERS[str(model_dir)] = load_tokenizer(model_dir)
    stop_checker = StopChecker(
        _TOKENIZERS[str(model_dir)], set(model_config.eos_token_ids), model_config.max_context_len
    )
    return Scheduler.create(model, pool, stop_checker, SchedulerConfig(**config))


def make_req(rid: str, input_ids: list[int], **params: object) -> Req:
    return Req(rid=rid, input_ids=list(input_ids), params=SamplingParams(**params))


def run_to_completion(
    scheduler: Scheduler,
    arrivals: dict[int, list[Req]] | None = None,
    max_steps: int = 10_000,
    after_step: Callable[[list[OutputRow]], None] | None = None,
) -> dict[str, list[int]]:
    """Step until idle, adding ``arrivals[step]`` before that step; tokens per rid."""
    arrivals = arrivals or {}
    tokens: dict[str, list[int]] = {}
    step = 0
    while scheduler.has_work or any(s >= step for s in arrivals):
        for req in arrivals.get(step, []):
            scheduler.add_request(req)
        rows: list[OutputRow] = scheduler.step()
        for row in rows:
            tokens.setdefault(row.rid, []).extend(row.new_token_ids)
        if after_step is not None:
            after_step(rows)
        step += 1
        assert step < max_steps, "scheduler did not finish"
    return tokens


def run_collecting_rows(
    scheduler: Scheduler, arrivals: dict[int, list[Req]]
) -> dict[str, list[OutputRow]]:
    """Step until idle, adding ``arrivals[step]`` first and checking KV conservation after
    each step; every row per rid."""
    rows: dict[str, list[OutputRow]] = {}
    step = 0
    while scheduler.has_work or any(s >= step for s in arrivals):
        for req in arrivals.get(step, []):
            scheduler.add_request(req)
        for row in scheduler.step():
            rows.setdefault(row.rid, []).append(row)
        assert_kv_conserved(scheduler)
        step += 1
        assert step < 5000, "scheduler did not finish"
    return rows


def assert_kv_returns_to_pool(scheduler: Scheduler) -> None:
    """Nothing holds KV: every slot is free or an unlocked cached prefix, and a flush frees all."""
    kv = scheduler.kv
    assert not scheduler.running and not scheduler.reqs
    assert kv.tree is None or kv.tree.num_locked == 0
    assert kv.num_free + kv.num_evictable == scheduler.kv_pool.num_tokens
    assert scheduler.flush_cache()
    assert kv.num_free == scheduler.kv_pool.num_tokens


def assert_kv_conserved(scheduler: Scheduler) -> None:
    """Every slot is free, in the prefix cache, or a running request's own tail."""
    kv = scheduler.kv
    owned = sum(len(r.kv_slots) - r.num_tree_tokens for r in scheduler.running)
    assert kv.num_free + kv.num_cached + owned == scheduler.kv_pool.num_tokens
