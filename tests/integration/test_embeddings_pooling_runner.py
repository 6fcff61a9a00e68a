"""A stack started with ``--runner pooling`` (scheduler, float32) and ``--pooling mean``
(frontend): embeddings equal HF's float32 mean-pooled hidden states to 1e-4, every
generating route is refused with a 400 that says why, and nothing ever decodes."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from transformers import PreTrainedModel

from services.common.tokenizer import load_tokenizer
from services.launch import LocalStack
from tests.integration.embedding_reference import ATOL, load_reference, max_error, pooled
from tests.live_stack import finish_counts, module_stack

stack = module_stack(
    "pooling-runner-logs",
    scheduler_args=["--runner", "pooling", "--dtype", "float32", "--num-threads", "1"],
    frontend_args=["--pooling", "mean"],
)

TEXTS = ["Mean pooling reads every token.", "b", "A longer prompt, " * 40]


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> PreTrainedModel:
    return load_reference(default_model_dir)


def test_mean_vectors_equal_hf_in_float32(
    client: openai.OpenAI, model_id: str, reference: PreTrainedModel, default_model_dir: Path
) -> None:
    tokenizer = load_tokenizer(default_model_dir)
    ids = [list(tokenizer.encode(t)) for t in TEXTS]
    as_floats = client.embeddings.create(model=model_id, input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model=model_id, input=ids)  # the SDK's default
    assert as_floats.usage.prompt_tokens == sum(map(len, ids))
    for got in (as_floats, as_base64):
        for data, want_ids in zip(got.data, ids, strict=True):
            assert max_error(data.embedding, pooled(reference, want_ids, "mean")) < ATOL


def test_generation_is_refused_by_a_pooling_server(
    stack: LocalStack, client: openai.OpenAI, model_id: str
) -> None:
    before = finish_counts(stack)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert "pooling" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt="hi", max_tokens=4)
    info = httpx.get(f"http://{stack.host}:{stack.ports.gateway}/get_model_info", timeout=10)
    assert info.json()["is_generation"] is False
    assert finish_counts(stack) == before  # nothing reached the scheduler
