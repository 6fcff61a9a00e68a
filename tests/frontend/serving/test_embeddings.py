"""EmbeddingServing: what it dispatches and what it refuses, on a scripted manager.

The manager stands in for the schedulers and the detokenizer: it records the requests
and answers each with one final row whose vector says which input it was. Each bad input
must be INVALID_ARGUMENT naming the client's field, before anything is dispatched.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf import json_format
from tokenline.v1 import detokenizer_pb2, embeddings_pb2, scheduler_pb2
from transformers import PreTrainedTokenizerBase

from services.common.errors import InvalidArgumentError, UnavailableError
from services.frontend.dispatch.batch_tokenizer import DynamicBatchTokenizer
from services.frontend.dispatch.tokenizer_manager import TokenizedRequest
from services.frontend.serving.base import ServingContext
from services.frontend.serving.embeddings import EmbeddingServing
from services.frontend.validation.limits import ModelLimits

HIDDEN = 4
CONTEXT = 16


class PoolingManager:
    """Answers input j with the vector [j, len(ids), 0.5, -1] (``abort``: an abort row)."""

    def __init__(self, *, pooling_only: bool = False, abort: bool = False) -> None:
        self.requests: list[TokenizedRequest] = []
        self.abort = abort
        self.router = SimpleNamespace(
            context_length=lambda: CONTEXT,
            hidden_size=lambda: HIDDEN,
            runs_pooling_only=lambda: pooling_only,
        )

    def new_rid(self) -> str:
        return f"rid-{len(self.requests)}-{id(object())}"

    @contextlib.asynccontextmanager
    async def open(self, requests: list[TokenizedRequest]) -> AsyncIterator[Any]:
        self.requests += requests
        yield self._rows(requests)

    async def generate(self, requests: list[TokenizedRequest]) -> AsyncIterator[Any]:
        async with self.open(requests) as rows:
            async for item in rows:
                yield item

    async def _rows(self, requests: list[TokenizedRequest]) -> AsyncIterator[Any]:
        for j, req in reversed(list(enumerate(requests))):  # out of order, as steps may
            row = detokenizer_pb2.StrRow(rid=req.rid)
            row.finish_reason.kind = row.finish_reason.KIND_ABORT if self.abort else 1
            row.usage.prompt_tokens = len(req.input_ids)
            if not self.abort:
                row.embedding.extend([float(j), float(len(req.input_ids)), 0.5, -1.0])
            yield j, row


@pytest.fixture
async def make_serving(tokenizer: PreTrainedTokenizerBase):
    batchers: list[DynamicBatchTokenizer] = []

    def make(**manager: bool) -> tuple[EmbeddingServing, PoolingManager]:
        batchers.append(DynamicBatchTokenizer(tokenizer))
        fake = PoolingManager(**manager)
        ctx = ServingContext(
            tokenizer=tokenizer,
            batcher=batchers[-1],
            manager=fake,  # type: ignore[arg-type]
            limits=ModelLimits(
                vocab_size=len(tokenizer), context_length=4096, default_max_tokens=64
            ),
            model_name="tiny",
        )
        return EmbeddingServing(ctx, "mean"), fake

    yield make
    for batcher in batchers:
        await batcher.close()


def request(**fields: Any) -> embeddings_pb2.EmbeddingRequest:
    return json_format.ParseDict(fields, embeddings_pb2.EmbeddingRequest())


async def test_each_input_is_one_pooling_request_answered_in_input_order(
    make_serving: Any, tokenizer: PreTrainedTokenizerBase
) -> None:
    serving, manager = make_serving()
    texts = ["hello world", "a", "three words here"]
    reply = await serving.embed(request(texts={"texts": texts}, requestId="abc"))
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert [d.embedding[0] for d in reply.data] == [0.0, 1.0, 2.0]
    ids = [tokenizer.encode(t) for t in texts]  # BOS added, as for any plain prompt
    assert [r.input_ids for r in manager.requests] == ids
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    assert reply.id == "embd-abc" and reply.object == "list" and reply.model == "tiny"
    for req in manager.requests:
        assert req.params.max_new_tokens == 0 and not req.stream
        assert req.pooling == scheduler_pb2.PoolingParams(
            method=scheduler_pb2.PoolingParams.METHOD_MEAN, normalize=True
        )
    assert [r.label for r in manager.requests] == ["abc-0", "abc-1", "abc-2"]


async def test_token_ids_and_base64_and_normalize(make_serving: Any) -> None:
    serving, manager = make_serving()
    reply = await serving.embed(
        request(tokenIdLists={"lists": [{"ids": [0, 5]}, {"ids": [7]}]}, encodingFormat="base64")
    )
    assert [r.input_ids for r in manager.requests] == [[0, 5], [7]]
    assert not reply.data[0].embedding
    assert struct.unpack("<4f", reply.data[1].embedding_bytes) == (1.0, 1.0, 0.5, -1.0)
    await serving.embed(request(tokenIds={"ids": [3, 4, 5]}, normalize=False, dimensions=HIDDEN))
    assert manager.requests[-1].input_ids == [3, 4, 5]
    assert manager.requests[-1].pooling is not None
    assert not manager.requests[-1].pooling.normalize


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({}, "input"),
        ({"text": ""}, "input"),
        ({"texts": {}}, "input"),
        ({"texts": {"texts": ["fine", ""]}}, "input[1]"),
        ({"tokenIds": {}}, "input"),
        ({"tokenIds": {"ids": [0, -1]}}, "input"),
        ({"tokenIdLists": {"lists": [{"ids": [1]}, {"ids": [0, 10**9]}]}}, "input[1]"),
        ({"tokenIdLists": {"lists": [{"ids": [1]}, {}]}}, "input[1]"),
        ({"tokenIdLists": {}}, "input"),
        ({"tokenIdLists": {"lists": [{"ids": [1]}, {"ids": [1] * (CONTEXT + 1)}]}}, "input[1]"),
        ({"text": "word " * 40}, "input"),
        ({"text": "x", "encodingFormat": "int8"}, "encoding_format"),
        ({"text": "x", "dimensions": 2}, "dimensions"),
        ({"text": "x", "model": "other"}, "model"),
    ],
)
async def test_bad_input_is_refused_by_name_and_nothing_is_dispatched(
    make_serving: Any, fields: dict[str, Any], field: str
) -> None:
    serving, manager = make_serving()
    with pytest.raises(Exception) as err:  # noqa: PT011 - NOT_FOUND for the model, else invalid
        await serving.embed(request(**fields))
    assert getattr(err.value, "field", None) == field
    assert field == "model" or isinstance(err.value, InvalidArgumentError)
    assert manager.requests == []


async def test_an_input_ended_without_a_vector_fails_the_whole_request(
    make_serving: Any,
) -> None:
    serving, _ = make_serving(abort=True)
    with pytest.raises(UnavailableError):
        await serving.embed(request(texts={"texts": ["a", "b"]}))


async def test_a_pooling_runner_refuses_generation_and_serves_embeddings(
    make_serving: Any,
) -> None:
    serving, _ = make_serving(pooling_only=True)
    with pytest.raises(InvalidArgumentError) as err:
        serving.check_generates()  # what chat, completions, responses and generate call
    assert "--runner pooling" in err.value.message
    reply = await serving.embed(request(text="still served"))
    assert len(reply.data) == 1
