"""The transformers path through the whole stack with the openai SDK, in float32, on tiny
checkpoints of three architectures tokenline has no native code for.

Per architecture: ``/v1/models`` reports the architecture and the path; greedy
completions of a batch of mixed-length prompts equal HF ``generate`` (a divergence only
at an HF near-tie) and their prompt logprobs are HF's within 1e-3; chat is refused for a
tokenizer without a chat template, and works once ``--chat-template FILE`` gives one.
And ``--model-impl native`` on such a checkpoint is refused in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.launch import LocalStack
from tests.live_stack import dump_logs, ports_beside, wait_until_settled
from tests.scheduler.model_executor.models.test_transformers_parity import (
    assert_same_until_near_tie,
)
from tests.scheduler.parity import hf_greedy
from tests.tiny_checkpoints import ARCHITECTURES, build_checkpoint

pytestmark = pytest.mark.live

NEW_TOKENS = 8
LOGPROB_ATOL = 1e-3
PROMPTS = [[0, *range(1000, 1003)], [0, *range(5000, 5040, 2)], [0, *range(20000, 20011)]]
START_TIMEOUT_S = 240.0
ONE_DETOKENIZER = ("scheduler", "frontend", "gateway")  # the session stack's serves all three
WITH_CHAT_TEMPLATE_FLAG = "cohere"  # the others run without one, so chat is refused


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> dict:
    """Each architecture's tiny checkpoint, its tokenizer without a chat template."""
    return {
        arch: build_checkpoint(
            arch, tmp_path_factory.mktemp(f"tiny-{arch}"), default_model_dir, chat_template=False
        )
        for arch in ARCHITECTURES
    }


@pytest.fixture(scope="module")
def stacks(
    checkpoints: dict[str, Path],
    default_model_dir: Path,
    shared_stack: LocalStack,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[dict[str, LocalStack]]:
    """One scheduler, frontend and gateway per architecture, started side by side (a start
    is mostly imports and model loading, which the three can overlap), all pushing to the
    session stack's detokenizer: the checkpoints share the default model's tokenizer."""
    template = ["--chat-template", str(default_model_dir / "chat_template.jinja")]
    wait_until_settled(shared_stack)
    live = {
        arch: LocalStack(
            str(checkpoint),
            ports_beside(shared_stack.ports, "detokenizer"),
            scheduler_args=["--dtype", "float32", "--model-impl", "transformers"]
            + ["--kv-cache-tokens", "4096", "--num-threads", "1"],
            frontend_args=template if arch == WITH_CHAT_TEMPLATE_FLAG else [],
            log_dir=tmp_path_factory.mktemp(f"stack-{arch}"),
        )
        for arch, checkpoint in checkpoints.items()
    }
    failed_before = request.session.testsfailed
    try:
        with ThreadPoolExecutor(len(live)) as pool:
            # Three starts share the cores: each gets the time the suite gives one alone,
            # twice over.
            list(pool.map(lambda one: one.start(START_TIMEOUT_S, ONE_DETOKENIZER), live.values()))
        yield live
    finally:
        with ThreadPoolExecutor(len(live)) as pool:
            list(pool.map(LocalStack.stop, live.values()))
        if request.session.testsfailed > failed_before or sys.exc_info()[0] is not None:
            for one in live.values():
                assert one.log_dir is not None
                dump_logs(one.log_dir)


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def client(stacks: dict[str, LocalStack], arch: str) -> openai.OpenAI:
    url = stacks[arch].base_url
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture
def checkpoint(checkpoints: dict[str, Path], arch: str) -> Path:
    return checkpoints[arch]


@pytest.fixture
def hf_model(checkpoint: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def test_models_and_get_info_report_architecture_and_path(
    client: openai.OpenAI, checkpoint: Path, stacks: dict[str, LocalStack], arch: str
) -> None:
    saved = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    scheduler = stacks[arch].scheduler_info()
    assert (scheduler.architecture, scheduler.model_impl) == (
        saved["architectures"][0],
        "transformers",
    )
    (model,) = client.models.list().data
    extra = model.model_extra or {}
    assert (extra["architecture"], extra["model_impl"]) == (
        scheduler.architecture,
        scheduler.model_impl,
    )


def test_greedy_batch_and_prompt_logprobs_match_hf(
    client: openai.OpenAI, model_id: str, hf_model: PreTrainedModel
) -> None:
    out = client.completions.create(
        model=model_id,
        prompt=PROMPTS,
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        extra_body={"return_token_ids": True, "prompt_logprobs": 0},
    )
    choices = sorted(out.choices, key=lambda c: c.index)
    for prompt, choice in zip(PROMPTS, choices, strict=True):
        extra = choice.model_extra or {}
        want, gaps = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert_same_until_near_tie(want, list(extra["token_ids"]), gaps)
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], dim=-1)
        entries = extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt)
        for pos in range(1, len(prompt)):
            got = entries[pos][str(prompt[pos])]["logprob"]
            assert abs(got - float(ref[pos - 1, prompt[pos]])) < LOGPROB_ATOL, pos


def test_chat_needs_a_template_and_the_flag_gives_one(
    client: openai.OpenAI, model_id: str, arch: str
) -> None:
    messages = [{"role": "user", "content": "Hello there."}]
    if arch != WITH_CHAT_TEMPLATE_FLAG:
        with pytest.raises(openai.APIStatusError, match="use completions"):
            client.chat.completions.create(model=model_id, messages=messages, max_tokens=2)
        return
    reply = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=3, temperature=0.0
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == 3 or reply.choices[0].finish_reason == "stop"
    # The prompt is the rendered template (BOS, role markers), not the bare text.
    bare = client.completions.create(model=model_id, prompt="Hello there.", max_tokens=1)
    assert reply.usage.prompt_tokens > bare.usage.prompt_tokens


def test_native_path_refuses_in_one_line(checkpoints: dict[str, Path]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.scheduler", "--model", str(checkpoints["olmo2"])]
        + ["--model-impl", "native", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "unsupported architectures" in lines[0] and "--model-impl native" in lines[0]
    assert "use --model-impl transformers" in lines[0]
