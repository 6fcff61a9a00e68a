"""OpenAI's Embeddings API: each input is one prefill-only scheduler request.

Every input is checked (not empty, token ids in the vocabulary, within the context the
schedulers enforce) before any is dispatched, so a bad input refuses the whole request
by its name (``input`` or ``input[i]``) and nothing is served half-way. Each input then
becomes a request with ``max_new_tokens`` 0 and ``PoolingParams`` (the method this
frontend was started with, ``--pooling``): the scheduler batches it with everything
else, samples nothing, and ends it once its prompt is computed, its one row carrying the
pooled final hidden state.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Literal

from tokenline.v1 import common_pb2, detokenizer_pb2, embeddings_pb2, scheduler_pb2

from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.sampling_params import SamplingParams
from services.frontend.dispatch.tokenizer_manager import TokenizedRequest
from services.frontend.serving.base import ServingBase, ServingContext, new_times

PoolingMethod = Literal["last", "mean", "cls"]
POOLING_METHODS: dict[PoolingMethod, int] = {
    "last": scheduler_pb2.PoolingParams.METHOD_LAST,
    "mean": scheduler_pb2.PoolingParams.METHOD_MEAN,
    "cls": scheduler_pb2.PoolingParams.METHOD_CLS,
}
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingInputs:
    """The request's inputs as token ids, each with the name a refusal gives it."""

    id_lists: list[list[int]]
    fields: list[str]


class EmbeddingServing(ServingBase):
    def __init__(self, ctx: ServingContext, pooling: PoolingMethod = "last") -> None:
        super().__init__(ctx)
        self.pooling = pooling

    async def embed(
        self, request: embeddings_pb2.EmbeddingRequest
    ) -> embeddings_pb2.EmbeddingResponse:
        times = new_times()
        self.check_model(request.model)
        encoding = request.encoding_format or "float"
        if encoding not in ENCODING_FORMATS:
            raise InvalidArgumentError(
                f"must be float or base64, got {encoding!r}", field="encoding_format"
            )
        self._check_dimensions(request)
        inputs = await self._inputs(request)
        self._check_fit(inputs)
        times.templated = times.received  # no template stage
        times.tokenized = time.time()
        label = self.new_label(request.request_id)
        reqs = self._requests(label, inputs, request, times)
        rows = await self._collect(reqs)
        return _response(label, self.model_name, rows, encoding)

    def _check_dimensions(self, request: embeddings_pb2.EmbeddingRequest) -> None:
        """Only the model's own width: tokenline does no Matryoshka truncation."""
        if not request.HasField("dimensions"):
            return
        hidden = self.manager.router.hidden_size()
        if request.dimensions != hidden:
            raise InvalidArgumentError(
                f"only the model's hidden size ({hidden}) is served, got {request.dimensions}",
                field="dimensions",
            )

    async def _inputs(self, request: embeddings_pb2.EmbeddingRequest) -> EmbeddingInputs:
        kind = request.WhichOneof("input_kind")
        if kind == "text":
            return await self._texts([request.text], ["input"])
        if kind == "texts":
            texts = list(request.texts.texts)
            return await self._texts(texts, _item_fields(len(texts)))
        if kind == "token_ids":
            return self._token_ids([list(request.token_ids.ids)], ["input"])
        if kind == "token_id_lists":
            lists = [list(t.ids) for t in request.token_id_lists.lists]
            return self._token_ids(lists, _item_fields(len(lists)))
        raise InvalidArgumentError("is required", field="input")

    async def _texts(self, texts: list[str], fields: list[str]) -> EmbeddingInputs:
        if not texts:
            raise InvalidArgumentError("must not be an empty list", field="input")
        for text, field in zip(texts, fields, strict=True):
            if not text:
                raise InvalidArgumentError("must not be an empty string", field=field)
        # The tokenizer adds BOS where the model expects it, as vLLM embeds a prompt.
        id_lists = await self.ctx.batcher.encode_many(texts, True)
        for ids, field in zip(id_lists, fields, strict=True):
            if not ids:
                raise InvalidArgumentError("has no tokens", field=field)
        return EmbeddingInputs(id_lists, fields)

    def _token_ids(self, id_lists: list[list[int]], fields: list[str]) -> EmbeddingInputs:
        if not id_lists:
            raise InvalidArgumentError("must not be an empty list", field="input")
        for ids, field in zip(id_lists, fields, strict=True):
            if not ids:
                raise InvalidArgumentError("must not be an empty list of token ids", field=field)
            self.check_vocab_range(ids, field)
        return EmbeddingInputs(id_lists, fields)

    def _check_fit(self, inputs: EmbeddingInputs) -> None:
        """Each input within the context the schedulers enforce (a pooling request keeps
        no output token, so the whole context is its)."""
        context = self.limits.context_length
        for ids, field in zip(inputs.id_lists, inputs.fields, strict=True):
            if len(ids) > context:
                raise InvalidArgumentError(
                    f"{len(ids)} tokens do not fit the model's context of {context}",
                    field=field,
                )

    def _requests(
        self,
        label: str,
        inputs: EmbeddingInputs,
        request: embeddings_pb2.EmbeddingRequest,
        times: common_pb2.StageTimes,
    ) -> list[TokenizedRequest]:
        normalize = request.normalize if request.HasField("normalize") else True
        pooling = scheduler_pb2.PoolingParams(
            method=POOLING_METHODS[self.pooling],  # type: ignore[arg-type]
            normalize=normalize,
        )
        params = SamplingParams(max_new_tokens=0)
        batched = len(inputs.id_lists) > 1
        return [
            TokenizedRequest(
                self.manager.new_rid(),
                ids,
                dataclasses.replace(params),
                times=times,
                label=f"{label}-{j}" if batched else label,
                stream=False,
                pooling=pooling,
            )
            for j, ids in enumerate(inputs.id_lists)
        ]

    async def _collect(self, reqs: list[TokenizedRequest]) -> list[detokenizer_pb2.StrRow]:
        """Every input's final row, in input order; an input the scheduler ended without
        a vector (aborted) fails the request, so nothing is served half-way."""
        rows: list[detokenizer_pb2.StrRow | None] = [None] * len(reqs)
        async with aclosing(self.manager.generate(reqs)) as stream:
            async for index, row in stream:
                if row.HasField("finish_reason"):
                    rows[index] = row
        out = []
        for j, row in enumerate(rows):
            if row is None or not len(row.embedding):
                why = "" if row is None else f": {row.finish_reason.message}"
                raise UnavailableError(f"input {j} ended without an embedding{why}")
            out.append(row)
        return out


def _item_fields(num: int) -> list[str]:
    return [f"input[{j}]" for j in range(num)]


def _response(
    label: str, model: str, rows: Sequence[detokenizer_pb2.StrRow], encoding: str
) -> embeddings_pb2.EmbeddingResponse:
    num_prompt = sum(row.usage.prompt_tokens for row in rows)
    response = embeddings_pb2.EmbeddingResponse(
        id=f"embd-{label}",
        object="list",
        created=int(time.time()),
        model=model,
        usage=embeddings_pb2.EmbeddingUsage(prompt_tokens=num_prompt, total_tokens=num_prompt),
    )
    for j, row in enumerate(rows):
        data = response.data.add(object="embedding", index=j)
        if encoding == "base64":
            data.embedding_bytes = float32_le_bytes(row.embedding)
        else:
            data.embedding.extend(row.embedding)
    return response


def float32_le_bytes(values: Sequence[float]) -> bytes:
    """Little-endian float32, what OpenAI's SDK decodes a base64 embedding as."""
    return struct.pack(f"<{len(values)}f", *values)
