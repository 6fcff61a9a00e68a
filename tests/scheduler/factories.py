"""One-line builders for a CPU scheduler core over the real default model."""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.scheduler.engine import OutputRow, Scheduler, SchedulerConfig
from services.scheduler.kv_pool import KVPool
from services.scheduler.model.loader import load_model
from services.scheduler.req import Req
from services.scheduler.stop_checker import StopChecker

_MODELS: dict[tuple[str, torch.dtype], tuple] = {}


def make_scheduler(
    model_dir: Path,
    *,
    kv_tokens: int = 4096,
    dtype: torch.dtype = torch.float32,
    **config: int,
) -> Scheduler:
    key = (str(model_dir), dtype)
    if key not in _MODELS:  # loading is the slow part; the model is read-only
        _MODELS[key] = load_model(model_dir, dtype, "cpu")
    model, model_config = _MODELS[key]
    pool = KVPool(
        kv_tokens, model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype
    )
    stop_checker = StopChecker(
        load_tokenizer(model_dir), set(model_config.eos_token_ids), model_config.max_context_len
    )
    return Scheduler(model, pool, stop_checker, SchedulerConfig(**config))


def make_req(rid: str, input_ids: list[int], **params: object) -> Req:
    return Req(rid=rid, input_ids=list(input_ids), params=SamplingParams(**params))


def run_to_completion(
    scheduler: Scheduler, arrivals: dict[int, list[Req]] | None = None, max_steps: int = 10_000
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
            tokens.setdefault(row.req.rid, []).extend(row.new_token_ids)
        step += 1
        assert step < max_steps, "scheduler did not finish"
    return tokens
