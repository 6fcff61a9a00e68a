"""The native generate API: text or ids, single or batch, results in input order."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from tokenline.v1 import common_pb2, detokenizer_pb2, generate_pb2

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.frontend.params import finalize_params
from services.frontend.serving_base import ServingBase
from services.frontend.tokenizer_manager import TokenizedRequest


class GenerateServing(ServingBase):
    async def prepare(self, request: generate_pb2.GenerateReqInput) -> list[TokenizedRequest]:
        times = common_pb2.StageTimes(received=time.time())
        if request.text and request.input_ids:
            raise InvalidArgumentError("give text or input_ids, not both", field="text")
        if request.text:
            id_lists = [self.tokenizer.encode(t) for t in request.text]
        else:
            id_lists = [list(t.ids) for t in request.input_ids]
        if not id_lists or any(not ids for ids in id_lists):
            raise InvalidArgumentError("text or input_ids must be non-empty", field="text")
        times.tokenized = time.time()
        top = request.logprob.top_logprobs_num
        self.check_logprobs(request.logprob.return_logprob, top)
        rid = self.new_rid(request.rid)
        has_limit = request.sampling_params.HasField("max_new_tokens")
        reqs: list[TokenizedRequest] = []
        for j, ids in enumerate(id_lists):
            params = SamplingParams.from_pb(request.sampling_params)
            params = finalize_params(params, has_limit, len(ids), self.limits)
            prefix = f"-{j}" if len(id_lists) > 1 else ""
            reqs += self.fan_out(
                rid, ids, params, request.logprob.return_logprob, top, times, prefix
            )
        return reqs

    async def complete(
        self, request: generate_pb2.GenerateReqInput
    ) -> generate_pb2.GenerateResponse:
        reqs = await self.prepare(request)
        outputs = [generate_pb2.GenerateOutput(rid=r.rid, index=i) for i, r in enumerate(reqs)]
        async for index, row in self.manager.generate(reqs):
            _merge(outputs[index], row)
        return generate_pb2.GenerateResponse(outputs=outputs)

    async def stream(
        self, request: generate_pb2.GenerateReqInput
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        reqs = await self.prepare(request)
        async for index, row in self.manager.generate(reqs):
            out = generate_pb2.GenerateOutput(rid=reqs[index].rid, index=index)
            _merge(out, row)
            yield generate_pb2.GenerateResponse(outputs=[out])


def _merge(out: generate_pb2.GenerateOutput, row: detokenizer_pb2.StrRow) -> None:
    out.text += row.text
    out.output_ids.extend(row.output_ids)
    out.logprobs.extend(row.logprobs)
    if row.HasField("finish_reason"):
        out.finish_reason.CopyFrom(row.finish_reason)
        out.meta_info.CopyFrom(
            generate_pb2.MetaInfo(
                prompt_tokens=row.usage.prompt_tokens,
                completion_tokens=row.usage.completion_tokens,
                cached_tokens=row.usage.cached_tokens,
                times=row.times,
            )
        )
