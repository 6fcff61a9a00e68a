"""``--quantization w8a8`` through the whole stack with the openai SDK, on the default model
in bf16: greedy completions of a batch of mixed-length prompts are the in-process w8a8
model's (a divergence only at its own near-tie), and the same prompts served again give
the same tokens. Skipped where the kernel level has no AVX512-VNNI (there the flag is
refused in one line: ``tests/.../test_w8a8.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from services.launch import LocalStack
from services.scheduler.model_executor.row_kernels import use_row_kernels
from services.scheduler.ops.cpu_kernels import SampleKernel, find_compiler
from services.scheduler.ops.isa_levels import machine_level
from tests.live_stack import dump_logs, ports_beside, wait_until_settled
from tests.scheduler.factories import make_req, make_scheduler, run_to_completion
from tests.scheduler.model_executor.models.test_transformers_parity import (
    assert_same_until_near_tie,
)
from tests.scheduler.parity import all_logits

pytestmark = pytest.mark.live

NEW_TOKENS = 8
PROMPTS = [[0, *range(1000, 1003)], [0, *range(5000, 5040, 2)], [0, *range(20000, 20011)]]
START_TIMEOUT_S = 240.0
SERVICES = ("scheduler", "frontend", "gateway")  # the session stack's detokenizer serves it


@pytest.fixture(scope="module")
def stack(
    default_model_dir: Path,
    shared_stack: LocalStack,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalStack]:
    level = machine_level().name
    if level != "avx512_bf16":
        pytest.skip(f"w8a8 needs the avx512_bf16 kernel level; this CPU runs {level}")
    if find_compiler() is None:
        pytest.skip("w8a8 runs on the engine's kernels, which need a C++ compiler")
    wait_until_settled(shared_stack)
    live = LocalStack(
        str(default_model_dir),
        ports_beside(shared_stack.ports, "detokenizer"),
        scheduler_args=["--quantization", "w8a8", "--dtype", "bfloat16", "--build-kernels"]
        + ["--kv-cache-tokens", "4096", "--num-threads", "1"],
        log_dir=tmp_path_factory.mktemp("stack-w8a8"),
    )
    failed_before = request.session.testsfailed
    try:
        live.start(START_TIMEOUT_S, SERVICES)
        yield live
    finally:
        live.stop()
        if request.session.testsfailed > failed_before or sys.exc_info()[0] is not None:
            assert live.log_dir is not None
            dump_logs(live.log_dir)


def in_process_greedy(model_dir: Path) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens from the same checkpoint loaded with w8a8 in this
    process on the kernels the served scheduler built and runs (decode attention, the row
    kernels), with the gap between the top-2 logits at each step."""
    assert SampleKernel.load(model_dir) is not None
    load: dict[str, str | bool] = {"quantization": "w8a8", "decode_kernel": True}
    scheduler = make_scheduler(model_dir, kv_tokens=1024, dtype=torch.bfloat16, load=load)
    use_row_kernels(scheduler.runner.model)
    reqs = [
        make_req(str(i), prompt, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS)
    ]
    tokens = run_to_completion(scheduler, {0: reqs})
    out = []
    for i, prompt in enumerate(PROMPTS):
        got = tokens[str(i)]
        logits = all_logits(scheduler.runner.model, prompt + got[:-1], decode=len(got) - 1)
        steps = logits[len(prompt) - 1 :].float().topk(2).values
        out.append((got, (steps[:, 0] - steps[:, 1]).tolist()))
    return out


def test_greedy_batch_is_the_in_process_w8a8_models_and_repeats(
    stack: LocalStack, default_model_dir: Path
) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    model_id = client.models.list().data[0].id

    def served() -> list[list[int]]:
        out = client.completions.create(
            model=model_id,
            prompt=PROMPTS,
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        choices = sorted(out.choices, key=lambda c: c.index)
        return [list((choice.model_extra or {})["token_ids"]) for choice in choices]

    first = served()
    for (want, gaps), got in zip(in_process_greedy(default_model_dir), first, strict=True):
        assert len(got) == NEW_TOKENS
        assert_same_until_near_tie(want, got, gaps)
    assert served() == first
