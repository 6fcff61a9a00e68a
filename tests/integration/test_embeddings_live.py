"""/v1/embeddings on the shared stack (a generating model, ``--pooling last``), through the
official openai client and over gRPC: vectors equal HF's pooled hidden states, embedding
rows share steps with chat decodes and leave the chat answers as they were alone, and
every bad input is a 400 naming its field.

The shared stack's scheduler runs in float32 on every CPU (tests/live_stack.py), so the
vectors are compared with HF's float32 ones to 1e-4 wherever the suite runs.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from tokenline.v1 import embeddings_pb2, frontend_pb2_grpc
from transformers import PreTrainedModel

from services.common.tokenizer import load_tokenizer
from services.launch import LocalStack
from tests.integration.embedding_reference import ATOL, load_reference, max_error, pooled

TEXTS = ["The quick brown fox jumps over the lazy dog.", "a", "Embeddings " * 30]
CHATS = ["Write a short poem about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> PreTrainedModel:
    return load_reference(default_model_dir)


@pytest.fixture(scope="module")
def encode(default_model_dir: Path) -> Callable[[str], list[int]]:
    tokenizer = load_tokenizer(default_model_dir)
    return lambda text: list(tokenizer.encode(text))  # BOS added, as the frontend does


def chat(client: openai.OpenAI, model: str, prompt: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0.0,
        max_tokens=24,
        extra_body={"ignore_eos": True},
    )
    return reply.choices[0].message.content or ""


def test_vectors_equal_hf_beside_chat_decodes(
    stack: LocalStack,
    client: openai.OpenAI,
    model_id: str,
    reference: PreTrainedModel,
    encode: Callable[[str], list[int]],
) -> None:
    solo = [chat(client, model_id, p) for p in CHATS]
    ids = [encode(t) for t in TEXTS]
    # Every input form, float and base64 (the SDK's default, decoded by the SDK), sent
    # at once with the chats: their rows share steps with the chats' decodes.
    calls: list[tuple[Any, dict[str, Any]]] = [
        (client.embeddings.create, {"input": TEXTS[0], "encoding_format": "float"}),
        (client.embeddings.create, {"input": TEXTS}),
        (client.embeddings.create, {"input": ids[1], "encoding_format": "float"}),
        (client.embeddings.create, {"input": ids}),
    ]
    with ThreadPoolExecutor(len(calls) + len(CHATS)) as pool:
        chats = [pool.submit(chat, client, model_id, p) for p in CHATS]
        embeds = [pool.submit(fn, model=model_id, **kw) for fn, kw in calls]
        answers = [f.result() for f in chats]
        lists = [f.result() for f in embeds]
    assert answers == solo  # the shared stack is batch-invariant
    expected_inputs = [[ids[0]], ids, [ids[1]], ids]
    for got, inputs in zip(lists, expected_inputs, strict=True):
        assert [d.index for d in got.data] == list(range(len(inputs)))
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, inputs))
        assert got.model == model_id and got.object == "list"
        for data in got.data:
            assert len(data.embedding) == 256
            assert abs(sum(v * v for v in data.embedding) - 1.0) < 1e-4
    # Text and its token ids are the same prompt: the same vector.
    assert max_error(lists[0].data[0].embedding, lists[3].data[0].embedding) < ATOL
    for got, inputs in zip(lists, expected_inputs, strict=True):
        for data, want_ids in zip(got.data, inputs, strict=True):
            assert max_error(data.embedding, pooled(reference, want_ids, "last")) < ATOL


def test_base64_is_little_endian_float32_of_the_float_vector(
    stack: LocalStack, model_id: str
) -> None:
    def post(fmt: str) -> Any:
        body = {"model": model_id, "input": "bytes on the wire", "encoding_format": fmt}
        reply = httpx.post(f"{stack.base_url}/embeddings", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["data"][0]["embedding"]

    floats, encoded = post("float"), post("base64")
    raw = base64.b64decode(encoded)
    assert len(raw) == 4 * len(floats)
    # The second request reuses the first's cached prefix and computes only the last
    # token, in another batch shape: the same vector to float32 rounding, not bit for bit.
    assert max_error(list(struct.unpack(f"<{len(floats)}f", raw)), floats) < 1e-6


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["fine", ""]}, "input[1]"),
        ({"input": [[0, 5], []]}, "input[1]"),
        ({"input": [[0, 5], [0, 10**9]]}, "input[1]"),
        ({"input": [0, -3]}, "input"),
        ({"input": [7] * 5000}, "input"),
        ({"input": "x", "dimensions": 3}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"input": ["x", 3]}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    stack: LocalStack, model_id: str, body: dict[str, Any], param: str
) -> None:
    reply = httpx.post(f"{stack.base_url}/embeddings", json={"model": model_id, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_grpc_clients_embed_and_are_refused_by_field(stack: LocalStack, model_id: str) -> None:
    with grpc.insecure_channel(stack.addr("frontend")) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        ok = stub.Embed(embeddings_pb2.EmbeddingRequest(text="over gRPC"), timeout=60)
        assert len(ok.data) == 1 and len(ok.data[0].embedding) == 256
        texts = embeddings_pb2.EmbeddingTexts(texts=["fine", ""])
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(embeddings_pb2.EmbeddingRequest(texts=texts), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input[1]" in (err.value.details() or "")
