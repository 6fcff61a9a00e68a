"""Each natively served architecture through the whole stack with the openai SDK, in
float32, on a tiny random checkpoint HF builds and saves (tests/checkpoints.py): greedy
completions of mixed-length prompts, sent together so the scheduler batches them, equal
HF's ``generate``, and their prompt logprobs are within 1e-3 of HF's.

One stack serves them in turn: the checkpoints share the default model's tokenizer and
limits, so only the scheduler (which loads the weights) is restarted on each checkpoint;
four fresh processes per architecture would cost about 30 s each here."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from services.launch import LocalStack
from tests.checkpoints import build_hf_model, save_checkpoint
from tests.live_stack import running_stack
from tests.scheduler.parity import assert_same_greedy, hf_greedy
from tests.waiting import wait_until

pytestmark = pytest.mark.live

ARCHITECTURES = ("gemma3", "mixtral", "phi3", "qwen3", "qwen3_moe")
NEW_TOKENS = 8
LOGPROB_ATOL = 1e-3
PROMPTS = (
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    " ".join(f"item {i}: value {i * 7 % 13};" for i in range(8)),
)
SCHEDULER_ARGS = ["--dtype", "float32", "--kv-cache-tokens", "2048", "--num-threads", "1"]


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> dict[str, tuple[Path, PreTrainedModel]]:
    built = {}
    for name in ARCHITECTURES:
        hf_model = build_hf_model(name)
        out = save_checkpoint(hf_model, tmp_path_factory.mktemp(name), default_model_dir)
        built[name] = (out, hf_model)
    return built


@pytest.fixture(scope="module")
def stack(
    checkpoints: dict[str, tuple[Path, PreTrainedModel]],
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalStack]:
    first = checkpoints[ARCHITECTURES[0]][0]
    log_dir = tmp_path_factory.mktemp("native-models-logs")
    with running_stack(first, log_dir, request, scheduler_args=SCHEDULER_ARGS) as live:
        yield live


@pytest.fixture(params=ARCHITECTURES)
def served(
    request: pytest.FixtureRequest,
    stack: LocalStack,
    checkpoints: dict[str, tuple[Path, PreTrainedModel]],
) -> tuple[LocalStack, PreTrainedModel]:
    """The stack with its scheduler serving the architecture's checkpoint."""
    out, hf_model = checkpoints[request.param]
    if stack.model != str(out):
        stack.kill("scheduler")  # its graceful drain waits on the frontend's stream
        stack.model = str(out)
        stack.restart("scheduler")
        assert stack.scheduler_info().model == out.name
        # The frontend re-attaches to the new scheduler on its own; requests wait for that.
        wait_until(lambda: stack.scheduler_info().num_frontends >= 1, timeout=30)
    return stack, hf_model


@pytest.fixture(scope="module")
def prompt_ids(default_model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [[0, *tokenizer.encode(text, add_special_tokens=False)] for text in PROMPTS]


def complete(client: openai.OpenAI, ids: list[int]) -> Any:
    return client.completions.create(
        model=client.models.list().data[0].id,
        prompt=ids,
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        extra_body={"return_token_ids": True, "prompt_logprobs": 0},
    ).choices[0]


def hf_prompt_logprobs(hf_model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_greedy_completions_and_prompt_logprobs_match_hf(
    served: tuple[LocalStack, PreTrainedModel], prompt_ids: list[list[int]]
) -> None:
    stack, hf_model = served
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        choices = list(pool.map(lambda ids: complete(client, ids), prompt_ids))
    for ids, choice in zip(prompt_ids, choices, strict=True):
        expected, gaps = hf_greedy(hf_model, ids, NEW_TOKENS)
        assert_same_greedy(f"{len(ids)} tokens", expected, gaps, choice.model_extra["token_ids"])
        entries = choice.model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(ids)
        got = torch.tensor([entries[pos][str(ids[pos])]["logprob"] for pos in range(1, len(ids))])
        torch.testing.assert_close(
            got, hf_prompt_logprobs(hf_model, ids), atol=LOGPROB_ATOL, rtol=0.0
        )
