"""Chat completions: template, tokenize, fan out n choices, assemble OpenAI output."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tokenline.v1 import common_pb2, openai_pb2

from services.common.errors import UnavailableError
from services.frontend.chat_messages import ChatInput, chat_input
from services.frontend.chat_template import ChatTemplate
from services.frontend.output import finish_name, set_matched_stop, usage_of
from services.frontend.params import check_sampling, params_from_openai
from services.frontend.serving_base import LogprobRequest, ServingBase, new_times
from services.frontend.tokenizer_manager import TokenizedRequest


@dataclass(slots=True)
class PreparedChat:
    label: str  # the client's id: the response id is chatcmpl-<label>
    reqs: list[TokenizedRequest]
    logprob: LogprobRequest


class ChatServing(ServingBase):
    async def prepare(self, request: openai_pb2.ChatCompletionRequest) -> PreparedChat:
        times = new_times()
        max_completion = (
            request.max_completion_tokens if request.HasField("max_completion_tokens") else None
        )
        requested = params_from_openai(request.sampling, max_completion)
        check_sampling(requested, self.limits)
        await self.ctx.grammars.check(requested.params, requested.aliases)
        top = request.top_logprobs if request.HasField("top_logprobs") else 0
        logprob = LogprobRequest(request.logprobs, top)
        self.check_logprobs(logprob)
        template = self._template()
        ids = await self._tokenize(template, chat_input(request, template.content_format), times)
        label = self.new_label(request.request_id)
        reqs = self.build_requests(label, requested, [ids], "messages", logprob, times)
        return PreparedChat(label, reqs, logprob)

    def _template(self) -> ChatTemplate:
        if self.ctx.chat_template is None:
            raise UnavailableError("this model has no chat template; use completions")
        return self.ctx.chat_template

    async def _tokenize(
        self, template: ChatTemplate, chat: ChatInput, times: common_pb2.StageTimes
    ) -> list[int]:
        if template.tokenizes_in_template:
            ids = await self.ctx.batcher.run(functools.partial(template.tokenize, chat))
            times.templated = times.tokenized = time.time()
            return ids
        prompt = template.render(chat)
        times.templated = time.time()
        # The template wrote BOS and every control token itself.
        ids = await self.ctx.batcher.encode(prompt, add_special_tokens=False)
        times.tokenized = time.time()
        return ids

    async def complete(
        self, request: openai_pb2.ChatCompletionRequest
    ) -> openai_pb2.ChatCompletion:
        prep = await self.prepare(request)
        accs = await self.collect(prep.reqs)
        response = openai_pb2.ChatCompletion(
            id=f"chatcmpl-{prep.label}",
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
            if prep.logprob.enabled:
                choice.logprobs.CopyFrom(self.logprobs.chat_entries(acc.logprobs))
        if accs and accs[0].times is not None:
            response.times.CopyFrom(accs[0].times)
        return response

    async def stream(
        self, request: openai_pb2.ChatCompletionRequest
    ) -> AsyncIterator[openai_pb2.ChatCompletionChunk]:
        prep = await self.prepare(request)
        chunks = _ChunkMaker(prep.label, self.model_name, int(time.time()))
        include_usage = request.stream_options.include_usage
        # vLLM's rule: per-chunk usage only when usage was asked for at all.
        continuous = include_usage and request.stream_options.continuous_usage_stats
        num_prompt = len(prep.reqs[0].input_ids)
        usages: list[common_pb2.Usage] = []
        num_out = [0] * len(prep.reqs)
        async with self.manager.open(prep.reqs) as rows:
            yield chunks.role_chunk(len(prep.reqs))  # only once every choice is accepted
            async for index, row in rows:
                num_out[index] += len(row.output_ids)
                usage = self.running_usage(num_prompt, num_out) if continuous else None
                if row.text or row.logprobs:
                    out = chunks.make(usage)
                    choice = out.choices.add(index=index)
                    choice.delta.content = row.text
                    if prep.logprob.enabled:
                        choice.logprobs.CopyFrom(self.logprobs.chat_entries(list(row.logprobs)))
                    yield out
                if row.HasField("finish_reason"):
                    usages.append(row.usage)
                    done = chunks.finish_chunk(index, row.finish_reason, usage)
                    done.times.CopyFrom(row.times)
                    yield done
        if include_usage:
            yield chunks.make(usage_of(usages))


@dataclass(frozen=True, slots=True)
class _ChunkMaker:
    label: str
    model: str
    created: int

    def make(
        self, usage: openai_pb2.CompletionUsage | None = None
    ) -> openai_pb2.ChatCompletionChunk:
        chunk = openai_pb2.ChatCompletionChunk(
            id=f"chatcmpl-{self.label}",
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
        )
        if usage is not None:
            chunk.usage.CopyFrom(usage)
        return chunk

    def role_chunk(self, num_choices: int) -> openai_pb2.ChatCompletionChunk:
        chunk = self.make()
        for i in range(num_choices):
            chunk.choices.add(index=i).delta.MergeFrom(
                openai_pb2.ChatDelta(role="assistant", content="")
            )
        return chunk

    def finish_chunk(
        self,
        index: int,
        finish: common_pb2.FinishReason,
        usage: openai_pb2.CompletionUsage | None,
    ) -> openai_pb2.ChatCompletionChunk:
        chunk = self.make(usage)
        done = chunk.choices.add(index=index, finish_reason=finish_name(finish))
        done.delta.SetInParent()
        set_matched_stop(done, finish)
        return chunk
