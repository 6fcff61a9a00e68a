"""Limits on a small stack: the scheduler reports the context it enforces (here capped by
a small KV pool) and the dtype ``--dtype auto`` picks on this CPU; the frontend refuses at
the entry exactly what it could not serve; a request the detokenizer has no room for (one
decode state here) ends with an ``abort`` finish that says why, not a 500."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from services.launch import LocalStack
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.dtype import AUTO, choose_dtype
from tests.live_stack import module_stack

KV_TOKENS = 512  # far below the model's 4096 positions: the pool is the limit


stack = module_stack(
    "limits-logs",
    scheduler_args=["--kv-cache-tokens", str(KV_TOKENS), "--num-threads", "1"],
    detokenizer_args=["--max-decode-states", "1"],
)


def completion(stack: LocalStack, prompt: str, **fields: object) -> httpx.Response:
    body = {"model": "tokenline-tiny", "prompt": prompt, **fields}
    return httpx.post(f"{stack.base_url}/completions", json=body, timeout=60)


def test_the_frontend_refuses_what_the_scheduler_could_not_hold(stack: LocalStack) -> None:
    tokenized = httpx.post(
        f"http://{stack.host}:{stack.ports.gateway}/v1/tokenize",
        json={"model": "tokenline-tiny", "prompt": "word " * 600},
        timeout=30,
    ).json()
    assert tokenized["max_model_len"] == KV_TOKENS
    assert tokenized["count"] > KV_TOKENS

    too_long = completion(stack, "word " * 600, max_tokens=1)
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "prompt"
    too_much = completion(stack, "word " * 100, max_tokens=KV_TOKENS)
    assert too_much.status_code == 400 and too_much.json()["error"]["param"] == "max_tokens"

    fits = completion(stack, "word " * 100, max_tokens=8, ignore_eos=True)
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["completion_tokens"] == 8
    served_default = completion(stack, "word " * 100, ignore_eos=True)  # as many as fit
    usage = served_default.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == KV_TOKENS


def test_a_request_the_detokenizer_refuses_finishes_with_abort_and_its_reason(
    stack: LocalStack,
) -> None:
    url = f"{stack.base_url}/chat/completions"
    body = {
        "model": "tokenline-tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 300,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url, json=body | {"stream": True}) as first,
    ):
        lines = first.iter_lines()  # held: dropping it would cancel the stream
        while '"content"' not in next(lines):  # decoding: it holds the one state
            pass
        second = http.post(url, json=body | {"max_tokens": 4})
        assert second.status_code == 200, second.text
        choice = second.json()["choices"][0]
        assert choice["finish_reason"] == "abort"
        assert "--max-decode-states" in choice["stop_reason"]


def test_the_card_reports_the_dtype_auto_picks_on_this_cpu(
    stack: LocalStack, default_model_dir: Path
) -> None:
    """bf16 where the CPU computes it natively (AVX512_BF16 or AMX), else float32; the
    scheduler's GetInfo and the model card say the same."""
    checkpoint = ModelConfig.from_dir(default_model_dir).dtype
    expected = choose_dtype(AUTO, checkpoint, torch.device("cpu")).name
    assert stack.scheduler_info().dtype == expected
    card = httpx.get(f"{stack.base_url}/models", timeout=10).json()["data"][0]
    assert card["dtype"] == expected
    reply = completion(stack, "The sea", max_tokens=4, ignore_eos=True)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
