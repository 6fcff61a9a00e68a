"""Legacy completions: one or more prompts (text or ids), n choices each.

Choice ``j * n + i`` is choice i of prompt j, as OpenAI numbers them. ``echo``
puts the prompt's text before the completion; ``suffix`` (insertion) is refused.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tokenline.v1 import openai_pb2

from services.common.errors import InvalidArgumentError
from services.frontend.output import ChoiceAccumulator, finish_name, set_matched_stop
from services.frontend.params import check_sampling, params_from_openai
from services.frontend.serving_base import LogprobRequest, ServingBase, new_times
from services.frontend.tokenizer_manager import TokenizedRequest


@dataclass(slots=True)
class PreparedCompletion:
    label: str  # the client's id: the response id is cmpl-<label>
    reqs: list[TokenizedRequest]
    prompts: list[str]  # each prompt's text (for echo; empty strings otherwise)
    num_prompt_tokens: int
    logprob: LogprobRequest

    @property
    def n(self) -> int:
        return len(self.reqs) // len(self.prompts)


class CompletionServing(ServingBase):
    async def prepare(self, request: openai_pb2.CompletionRequest) -> PreparedCompletion:
        times = new_times()
        if request.suffix:
            raise InvalidArgumentError("suffix is not supported by this server", field="suffix")
        if request.prompts and request.prompt_token_ids:
            raise InvalidArgumentError(
                "give prompt as text or as token ids, not both", field="prompt"
            )
        requested = params_from_openai(request.sampling)
        check_sampling(requested, self.limits)
        await self.ctx.grammars.check(requested.params, requested.aliases)
        logprob = LogprobRequest(request.HasField("logprobs"), request.logprobs)
        self.check_logprobs(logprob, field="logprobs")
        times.templated = times.received  # no template stage
        if request.prompts:
            id_lists = await self.encode_prompts(list(request.prompts), "prompt")
        else:
            id_lists = [list(t.ids) for t in request.prompt_token_ids]
            self.check_id_lists(id_lists, "prompt")
        times.tokenized = time.time()
        label = self.new_label(request.request_id)
        reqs = self.build_requests(label, requested, id_lists, "prompt", logprob, times)
        prompts = self._echo_texts(request, reqs, len(id_lists))
        num_prompt = sum(len(r.input_ids) for r in reqs[:: len(reqs) // len(id_lists)])
        return PreparedCompletion(label, reqs, prompts, num_prompt, logprob)

    def _echo_texts(
        self, request: openai_pb2.CompletionRequest, reqs: list[TokenizedRequest], num: int
    ) -> list[str]:
        if not request.echo:
            return [""] * num
        if request.prompts:
            return list(request.prompts)
        n = len(reqs) // num
        return [str(self.tokenizer.decode(reqs[j * n].input_ids)) for j in range(num)]

    async def complete(self, request: openai_pb2.CompletionRequest) -> openai_pb2.Completion:
        prep = await self.prepare(request)
        accs = await self.collect(prep.reqs)
        response = openai_pb2.Completion(
            id=f"cmpl-{prep.label}",
            object="text_completion",
            created=int(time.time()),
            model=self.model_name,
            usage=self._usage(accs, prep.num_prompt_tokens),
        )
        for i, acc in enumerate(accs):
            head = prep.prompts[i // prep.n]
            choice = response.choices.add(
                index=i, text=head + acc.text, finish_reason=finish_name(acc.finish)
            )
            set_matched_stop(choice, acc.finish)
            if prep.logprob.enabled:
                choice.logprobs.CopyFrom(self.logprobs.completion_entries(acc.logprobs, len(head)))
        if accs and accs[0].times is not None:
            response.times.CopyFrom(accs[0].times)
        return response

    async def stream(
        self, request: openai_pb2.CompletionRequest
    ) -> AsyncIterator[openai_pb2.CompletionChunk]:
        prep = await self.prepare(request)
        make = _chunk_maker(prep.label, self.model_name, int(time.time()))
        include_usage = request.stream_options.include_usage
        continuous = include_usage and request.stream_options.continuous_usage_stats
        accs = [ChoiceAccumulator() for _ in prep.reqs]
        async with self.manager.open(prep.reqs) as rows:
            if request.echo:  # only once every choice is accepted
                head = make()
                for i in range(len(prep.reqs)):
                    head.choices.add(index=i, text=prep.prompts[i // prep.n])
                yield head
            async for index, row in rows:
                accs[index].add(row)
                if not (row.text or row.HasField("finish_reason") or row.logprobs):
                    continue
                out = make()
                choice = out.choices.add(index=index, text=row.text)
                if prep.logprob.enabled:
                    choice.logprobs.CopyFrom(self.logprobs.completion_entries(list(row.logprobs)))
                if row.HasField("finish_reason"):
                    choice.finish_reason = finish_name(row.finish_reason)
                    set_matched_stop(choice, row.finish_reason)
                    out.times.CopyFrom(row.times)
                if continuous:
                    out.usage.CopyFrom(self._running(accs, prep.num_prompt_tokens))
                yield out
        if include_usage:
            last = make()
            last.usage.CopyFrom(self._usage(accs, prep.num_prompt_tokens))
            yield last

    def _running(
        self, accs: list[ChoiceAccumulator], num_prompt: int
    ) -> openai_pb2.CompletionUsage:
        return self.running_usage(num_prompt, [a.num_output_tokens for a in accs])

    @staticmethod
    def _usage(accs: list[ChoiceAccumulator], num_prompt: int) -> openai_pb2.CompletionUsage:
        completion = sum(a.usage.completion_tokens for a in accs if a.usage is not None)
        cached = sum(a.usage.cached_tokens for a in accs if a.usage is not None)
        return openai_pb2.CompletionUsage(
            prompt_tokens=num_prompt,
            completion_tokens=completion,
            total_tokens=num_prompt + completion,
            prompt_tokens_details=openai_pb2.PromptTokensDetails(cached_tokens=cached),
        )


def _chunk_maker(label: str, model: str, created: int) -> Callable[[], openai_pb2.CompletionChunk]:
    def make() -> openai_pb2.CompletionChunk:
        return openai_pb2.CompletionChunk(
            id=f"cmpl-{label}", object="text_completion", created=created, model=model
        )

    return make
