"""The native generate API: text or ids, single or batch, results in input order.

Output ``index`` ``j * n + i`` is choice i of input j; its ``rid`` echoes the
client's: ``<rid>-<j>`` for batch element j (``<rid>-<j>-<i>`` with n > 1). Inside
the cluster each choice has a frontend-made rid of its own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from tokenline.v1 import common_pb2, generate_pb2

from services.common.errors import InvalidArgumentError
from services.frontend.output import ChoiceAccumulator
from services.frontend.params import check_sampling, params_from_native
from services.frontend.serving_base import LogprobRequest, ServingBase, new_times
from services.frontend.tokenizer_manager import TokenizedRequest


class GenerateServing(ServingBase):
    async def prepare(self, request: generate_pb2.GenerateReqInput) -> list[TokenizedRequest]:
        times = new_times()
        if request.text and request.input_ids:
            raise InvalidArgumentError("give text or input_ids, not both", field="text")
        requested = params_from_native(request.sampling_params)
        check_sampling(requested, self.limits)
        await self.ctx.grammars.check(requested.params, requested.aliases)
        logprob = LogprobRequest(request.logprob.return_logprob, request.logprob.top_logprobs_num)
        self.check_logprobs(logprob, field="top_logprobs_num")
        times.templated = times.received  # no template stage
        if request.text:
            id_lists = await self.encode_prompts(list(request.text), "text")
            field = "text"
        else:
            id_lists = [list(t.ids) for t in request.input_ids]
            self.check_id_lists(id_lists, "input_ids")
            field = "input_ids"
        times.tokenized = time.time()
        label = self.new_label(request.rid)
        return self.build_requests(label, requested, id_lists, field, logprob, times)

    async def complete(
        self, request: generate_pb2.GenerateReqInput
    ) -> generate_pb2.GenerateResponse:
        reqs = await self.prepare(request)
        accs = await self.collect(reqs)
        outputs = [
            _output(r.label, i, acc) for i, (r, acc) in enumerate(zip(reqs, accs, strict=True))
        ]
        return generate_pb2.GenerateResponse(outputs=outputs)

    async def stream(
        self, request: generate_pb2.GenerateReqInput
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        reqs = await self.prepare(request)
        async with aclosing(self.manager.generate(reqs)) as rows:
            async for index, row in rows:
                out = generate_pb2.GenerateOutput(
                    rid=reqs[index].label,
                    index=index,
                    text=row.text,
                    output_ids=row.output_ids,
                    logprobs=row.logprobs,
                )
                if row.HasField("finish_reason"):
                    _finish(out, row.finish_reason, row.usage, row.times)
                yield generate_pb2.GenerateResponse(outputs=[out])


def _output(rid: str, index: int, acc: ChoiceAccumulator) -> generate_pb2.GenerateOutput:
    out = generate_pb2.GenerateOutput(
        rid=rid, index=index, text=acc.text, output_ids=acc.output_ids, logprobs=acc.logprobs
    )
    if acc.finish is not None:
        _finish(out, acc.finish, acc.usage, acc.times)
    return out


def _finish(
    out: generate_pb2.GenerateOutput,
    finish: common_pb2.FinishReason,
    usage: common_pb2.Usage | None,
    times: common_pb2.StageTimes | None,
) -> None:
    usage = usage or common_pb2.Usage()
    out.finish_reason.CopyFrom(finish)
    out.meta_info.CopyFrom(
        generate_pb2.MetaInfo(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            times=times,
        )
    )
