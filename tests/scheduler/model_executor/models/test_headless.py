"""Headless checkpoints (a model body without an LM head, as embedding models ship them:
``Qwen3Model``, ``MistralModel``...) run on their causal LM's native module, for pooling only.

The checkpoint is saved by transformers' own ``Qwen3Model``, so its weights are named
without the ``model.`` prefix and there is no ``lm_head``; the reference is that same HF
module's ``last_hidden_state`` (after the final norm), pooled and L2-normalised, float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from services.scheduler.__main__ import parse_args, resolve_or_exit
from services.scheduler.model_executor.models.model_impl import resolve_model_impl
from services.scheduler.model_executor.pooling import PoolingMethod, PoolingState
from tests.checkpoints import _COMMON, HEAD_DIM, save_checkpoint
from tests.scheduler.factories import make_req, make_scheduler, run_collecting_rows

ATOL = 1e-4  # float32 against float32, as tests/scheduler/model_executor/test_pooling.py


@pytest.fixture(scope="module")
def headless(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path):
    config = transformers.Qwen3Config(**{**_COMMON, "head_dim": HEAD_DIM})
    torch.manual_seed(0)
    model = transformers.Qwen3Model(config).eval()
    out = save_checkpoint(model, tmp_path_factory.mktemp("qwen3-body"), default_model_dir)
    return model, out


def test_the_checkpoint_is_headless_and_served_natively(headless) -> None:
    _, out = headless
    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())  # a safe_open handle is not iterable
    assert "embed_tokens.weight" in names
    assert not any(n.startswith("model.") or n.startswith("lm_head") for n in names)
    impl = resolve_model_impl(out)
    assert (impl.architecture, impl.path, impl.headless) == ("Qwen3Model", "native", True)


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_pooled_vectors_equal_the_hf_body(headless, method: PoolingMethod) -> None:
    model, out = headless
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    scheduler = make_scheduler(out, max_num_batched_tokens=16, runner="pooling")
    reqs = [make_req(f"r{i}", ids, max_new_tokens=0) for i, ids in enumerate(prompts)]
    for req in reqs:
        req.pooling = PoolingState(method, True)
    rows = run_collecting_rows(scheduler, {0: reqs})
    for req, ids in zip(reqs, prompts, strict=True):
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        rows_used = {"last": hidden[-1:], "cls": hidden[:1], "mean": hidden}[method]
        want = torch.nn.functional.normalize(rows_used.mean(dim=0), dim=0)
        (row,) = rows[req.rid]
        torch.testing.assert_close(torch.tensor(row.embedding), want, atol=ATOL, rtol=0)


def test_a_headless_checkpoint_is_refused_without_the_pooling_runner(headless) -> None:
    _, out = headless
    with pytest.raises(SystemExit) as refused:
        resolve_or_exit(parse_args(["--model", str(out)]))
    message = str(refused.value)
    assert "Qwen3Model" in message and "--runner pooling" in message and "\n" not in message
    assert resolve_or_exit(parse_args(["--model", str(out), "--runner", "pooling"])).headless
