"""Chat completions: template, tokenize, fan out n choices, assemble OpenAI output."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from tokenline.v1 import common_pb2, openai_pb2

from services.frontend.chat_template import render_chat
from services.frontend.output import (
    finish_name,
    set_matched_stop,
    usage_of,
)
from services.frontend.params import finalize_params, params_from_openai
from services.frontend.serving_base import ServingBase
from services.frontend.tokenizer_manager import TokenizedRequest


class ChatServing(ServingBase):
    async def prepare(
        self, request: openai_pb2.ChatCompletionRequest
    ) -> tuple[str, list[TokenizedRequest]]:
        times = common_pb2.StageTimes(received=time.time())
        prompt = render_chat(self.tokenizer, request)
        times.templated = time.time()
        input_ids = await self.encode(prompt)
        times.tokenized = time.time()
        max_completion = (
            request.max_completion_tokens if request.HasField("max_completion_tokens") else None
        )
        params, has_limit = params_from_openai(request.sampling, max_completion)
        params = finalize_params(params, has_limit, len(input_ids), self.limits)
        top = request.top_logprobs if request.HasField("top_logprobs") else 0
        self.check_logprobs(request.logprobs, top)
        rid = self.new_rid(request.request_id)
        reqs = self.fan_out(rid, input_ids, params, request.logprobs, top, times)
        return rid, reqs

    async def complete(
        self, request: openai_pb2.ChatCompletionRequest
    ) -> openai_pb2.ChatCompletion:
        rid, reqs = await self.prepare(request)
        accs = await self.collect(reqs)
        response = openai_pb2.ChatCompletion(
            id=f"chatcmpl-{rid}",
            object="chat.completion",
            created=int(time.time()),
            model=self.model_name,
            usage=usage_of(accs),
        )
        for i, acc in enumerate(accs):
            choice = response.choices.add(index=i, finish_reason=finish_name(acc.finish))
            choice.message.role = "assistant"
            choice.message.content = acc.text
            set_matched_stop(choice, acc.finish)
            if request.logprobs:
                choice.logprobs.CopyFrom(self.logprobs.chat_entries(acc.logprobs))
        if accs and accs[0].times is not None:
            response.times.CopyFrom(accs[0].times)
        return response

    async def stream(
        self, request: openai_pb2.ChatCompletionRequest
    ) -> AsyncIterator[openai_pb2.ChatCompletionChunk]:
        rid, reqs = await self.prepare(request)
        created = int(time.time())
        include_usage = request.stream_options.include_usage
        continuous = request.stream_options.continuous_usage_stats

        def chunk() -> openai_pb2.ChatCompletionChunk:
            return openai_pb2.ChatCompletionChunk(
                id=f"chatcmpl-{rid}",
                object="chat.completion.chunk",
                created=created,
                model=self.model_name,
            )

        first = chunk()
        for i in range(len(reqs)):
            first.choices.add(index=i).delta.MergeFrom(
                openai_pb2.ChatDelta(role="assistant", content="")
            )
        yield first
        usages: list[common_pb2.Usage] = []
        num_out = [0] * len(reqs)
        async for index, row in self.manager.generate(reqs):
            num_out[index] += len(row.output_ids)
            if row.text or row.logprobs:
                out = chunk()
                choice = out.choices.add(index=index)
                choice.delta.content = row.text
                if request.logprobs:
                    choice.logprobs.CopyFrom(self.logprobs.chat_entries(list(row.logprobs)))
                if continuous:
                    out.usage.CopyFrom(self.running_usage(len(reqs[0].input_ids), num_out))
                yield out
            if row.HasField("finish_reason"):
                usages.append(row.usage)
                out = chunk()
                done = out.choices.add(index=index, finish_reason=finish_name(row.finish_reason))
                done.delta.SetInParent()
                set_matched_stop(done, row.finish_reason)
                if continuous:
                    out.usage.CopyFrom(self.running_usage(len(reqs[0].input_ids), num_out))
                yield out
        if include_usage:
            last = chunk()
            last.usage.CopyFrom(usage_of(usages))
            yield last
