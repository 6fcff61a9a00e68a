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
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.launch import LocalStack
from tests.live_stack import running_stack
from tests.scheduler.test_model_parity import hf_greedy
from tests.scheduler.test_transformers_parity import assert_same_until_near_tie
from tests.tiny_checkpoints import ARCHITECTURES, build_checkpoint

pytestmark = pytest.mark.live

NEW_TOKENS = 8
LOGPROB_ATOL = 1e-3
PROMPTS = [[0, *range(1000, 1003)], [0, *range(5000, 5040, 2)], [0, *range(20000, 20011)]]
WITH_CHAT_TEMPLATE_FLAG = "cohere"  # the others run without one, so chat is refused


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoint(arch: str, tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path):
    out = tmp_path_factory.mktemp(f"tiny-{arch}")
    return build_checkpoint(arch, out, default_model_dir, chat_template=False)


@pytest.fixture(scope="module")
def stack(
    arch: str,
    checkpoint: Path,
    default_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalStack]:
    scheduler = ["--dtype", "float32", "--model-impl", "transformers"]
    scheduler += ["--kv-cache-tokens", "4096", "--num-threads", "1"]
    frontend = []
    if arch == WITH_CHAT_TEMPLATE_FLAG:
        frontend = ["--chat-template", str(default_model_dir / "chat_template.jinja")]
    log_dir = tmp_path_factory.mktemp(f"stack-{arch}")
    with running_stack(
        checkpoint, log_dir, request, scheduler_args=scheduler, frontend_args=frontend
    ) as live:
        yield live


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def test_models_reports_architecture_and_path(client: openai.OpenAI, checkpoint: Path) -> None:
    (model,) = client.models.list().data
    extra = model.model_extra or {}
    assert extra["model_impl"] == "transformers"
    saved = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    assert extra["architecture"] == saved["architectures"][0]


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
    # The rendered template (BOS, the user turn) is what the prompt holds.
    assert reply.usage.prompt_tokens > len("Hello there.".split())


def test_native_path_refuses_in_one_line(checkpoint: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.scheduler", "--model", str(checkpoint)]
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
