"""Legacy completions: one or more prompts (text or ids), n choices each."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from tokenline.v1 import common_pb2, openai_pb2

from services.common.errors import InvalidArgumentError
from services.frontend.output import ChoiceAccumulator, finish_name, set_matched_stop
from services.frontend.params import finalize_params, params_from_openai
from services.frontend.serving_base import ServingBase
from services.frontend.tokenizer_manager import TokenizedRequest


class CompletionServing(ServingBase):
    async def prepare(
        self, request: openai_pb2.CompletionRequest
    ) -> tuple[str, list[TokenizedRequest], list[str], int]:
        """Returns rid, every choice's request, each prompt's text and the prompt token total."""
        times = common_pb2.StageTimes(received=time.time())
        if request.suffix:
            raise InvalidArgumentError("suffix is not supported by this server", field="suffix")
        if request.prompts and request.prompt_token_ids:
            raise InvalidArgumentError(
                "give prompt as text or as token ids, not both", field="prompt"
            )
        if request.prompts:
            prompts = list(request.prompts)
            id_lists = [await self.encode_prompt(p) for p in prompts]
        else:
            id_lists = [list(t.ids) for t in request.prompt_token_ids]
            prompts = [self.tokenizer.decode(ids) for ids in id_lists]
        if not id_lists or any(not ids for ids in id_lists):
            raise InvalidArgumentError("prompt must not be empty", field="prompt")
        times.tokenized = time.time()
        top = request.logprobs if request.HasField("logprobs") else 0
        self.check_logprobs(request.HasField("logprobs"), top)
        rid = self.new_rid(request.request_id)
        reqs: list[TokenizedRequest] = []
        for j, ids in enumerate(id_lists):
            params, has_limit = params_from_openai(request.sampling)
            params = finalize_params(params, has_limit, len(ids), self.limits)
            prefix = f"-p{j}" if len(id_lists) > 1 else ""
            reqs += self.fan_out(rid, ids, params, request.HasField("logprobs"), top, times, prefix)
        return rid, reqs, prompts, sum(len(ids) for ids in id_lists)

    async def encode_prompt(self, text: str) -> list[int]:
        # Plain completions get BOS when the tokenizer would add it.
        return self.tokenizer.encode(text)

    async def complete(self, request: openai_pb2.CompletionRequest) -> openai_pb2.Completion:
        rid, reqs, prompts, num_prompt = await self.prepare(request)
        accs = await self.collect(reqs)
        n = len(reqs) // len(prompts)
        response = openai_pb2.Completion(
            id=f"cmpl-{rid}",
            object="text_completion",
            created=int(time.time()),
            model=self.model_name,
            usage=self._usage(accs, num_prompt),
        )
        for i, acc in enumerate(accs):
            head = prompts[i // n] if request.echo else ""
            choice = response.choices.add(
                index=i, text=head + acc.text, finish_reason=finish_name(acc.finish)
            )
            set_matched_stop(choice, acc.finish)
            if request.HasField("logprobs"):
                choice.logprobs.CopyFrom(self.logprobs.completion_entries(acc.logprobs, len(head)))
        return response

    async def stream(
        self, request: openai_pb2.CompletionRequest
    ) -> AsyncIterator[openai_pb2.CompletionChunk]:
        rid, reqs, prompts, num_prompt = await self.prepare(request)
        created = int(time.time())
        n = len(reqs) // len(prompts)

        def chunk() -> openai_pb2.CompletionChunk:
            return openai_pb2.CompletionChunk(
                id=f"cmpl-{rid}",
                object="text_completion",
                created=created,
                model=self.model_name,
            )

        if request.echo:
            head = chunk()
            for i in range(len(reqs)):
                head.choices.add(index=i, text=prompts[i // n])
            yield head
        accs = [ChoiceAccumulator() for _ in reqs]
        async for index, row in self.manager.generate(reqs):
            accs[index].add(row)
            out = chunk()
            choice = out.choices.add(index=index, text=row.text)
            if request.HasField("logprobs"):
                choice.logprobs.CopyFrom(self.logprobs.completion_entries(list(row.logprobs)))
            if row.HasField("finish_reason"):
                choice.finish_reason = finish_name(row.finish_reason)
                set_matched_stop(choice, row.finish_reason)
            if row.text or row.HasField("finish_reason") or row.logprobs:
                yield out
        if request.stream_options.include_usage:
            last = chunk()
            last.usage.CopyFrom(self._usage(accs, num_prompt))
            yield last

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
