"""Legacy completions: one or more prompts (text or ids), n choices each.

Choice ``j * n + i`` is choice i of prompt j, as OpenAI numbers them. ``echo``
puts the prompt's text before the completion; ``suffix`` (insertion) is refused.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from tokenline.v1 import common_pb2, openai_pb2

from services.common.errors import InvalidArgumentError
from services.frontend.dispatch.tokenizer_manager import TokenizedRequest
from services.frontend.serving.base import LogprobRequest, ServingBase, new_times
from services.frontend.serving.output import (
    UnsentTokenIds,
    finish_name,
    set_matched_stop,
)
from services.frontend.validation.prompt_logprobs import prompt_logprobs_top, with_texts


@dataclass(slots=True)
class PreparedCompletion:
    label: str  # the client's id: the response id is cmpl-<label>
    reqs: list[TokenizedRequest]
    prompts: list[str]  # each prompt's text (for echo; empty strings otherwise)
    num_prompt_tokens: int
    logprob: LogprobRequest
    eos_ids: frozenset[int] = frozenset()  # stops on these report no stop_reason
    return_token_ids: bool = False

    @property
    def n(self) -> int:
        return len(self.reqs) // len(self.prompts)

    def prompt_ids(self, index: int) -> list[int]:
        """Choice ``index``'s prompt ids for return_token_ids (none when not asked)."""
        return self.reqs[index].input_ids if self.return_token_ids else []


class CompletionServing(ServingBase):
    async def prepare(self, request: openai_pb2.CompletionRequest) -> PreparedCompletion:
        times = new_times()
        if request.suffix:
            raise InvalidArgumentError("suffix is not supported by this server", field="suffix")
        if request.prompts and request.prompt_token_ids:
            raise InvalidArgumentError(
                "give prompt as text or as token ids, not both", field="prompt"
            )
        requested = self.openai_params(request)
        await self.ctx.grammars.check(requested.params, requested.aliases)
        logprob = LogprobRequest(request.HasField("logprobs"), request.logprobs)
        self.check_logprobs(logprob, field="logprobs")
        _ask_prompt_logprobs(request, logprob)
        times.templated = times.received  # no template stage
        if request.prompts:
            # vLLM's default for completions: the tokenizer's BOS (and the like) on.
            add = not request.HasField("add_special_tokens") or request.add_special_tokens
            id_lists = await self.encode_prompts(list(request.prompts), "prompt", add)
        else:
            id_lists = [list(t.ids) for t in request.prompt_token_ids]
            self.check_id_lists(id_lists, "prompt")
        times.tokenized = time.time()
        label = self.new_label(request.request_id)
        reqs = self.build_requests(label, requested, id_lists, "prompt", logprob, times)
        prompts = self._echo_texts(request, reqs, len(id_lists))
        num_prompt = sum(len(r.input_ids) for r in reqs[:: len(reqs) // len(id_lists)])
        return PreparedCompletion(
            label, reqs, prompts, num_prompt, logprob,
            self.eos_ids(requested), request.return_token_ids,
        )  # fmt: skip

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
            usage=self._usage([a.usage for a in accs], prep.num_prompt_tokens, prep.n),
        )
        for i, acc in enumerate(accs):
            head = prep.prompts[i // prep.n]
            choice = response.choices.add(
                index=i, text=head + acc.text, finish_reason=finish_name(acc.finish)
            )
            set_matched_stop(choice, acc.finish, prep.eos_ids)
            if prep.return_token_ids:
                choice.token_ids.extend(acc.output_ids)
                choice.prompt_token_ids.extend(prep.prompt_ids(i))
            if prep.logprob.enabled:
                choice.logprobs.CopyFrom(self._logprobs(acc.input_logprobs, acc.logprobs))
            if request.HasField("prompt_logprobs"):
                choice.prompt_logprobs.extend(with_texts(acc.input_logprobs, self._token_text))
        if accs and accs[0].times is not None:
            response.times.CopyFrom(accs[0].times)
        return response

    async def stream(
        self, request: openai_pb2.CompletionRequest
    ) -> AsyncGenerator[openai_pb2.CompletionChunk, None]:
        if request.HasField("prompt_logprobs"):  # a stream has no place for them
            prompt_logprobs_top(request.prompt_logprobs, stream=True)
        prep = await self.prepare(request)
        make = _chunk_maker(prep.label, self.model_name, int(time.time()))
        include_usage = request.stream_options.include_usage
        continuous = include_usage and request.stream_options.continuous_usage_stats
        # Only counts are kept while streaming: the text and logprobs went out in chunks.
        num_out = [0] * len(prep.reqs)
        usages: list[common_pb2.Usage | None] = [None] * len(prep.reqs)
        unsent_ids = UnsentTokenIds(prep.return_token_ids, len(prep.reqs))
        started = [False] * len(prep.reqs)  # prompt_token_ids go on a choice's first chunk
        async with self.manager.open(prep.reqs) as rows:
            if request.echo:  # only once every choice is accepted
                head = make()
                for i in range(len(prep.reqs)):
                    text = prep.prompts[i // prep.n]
                    head.choices.add(index=i, text=text, prompt_token_ids=prep.prompt_ids(i))
                    started[i] = True
                yield head
            async for index, row in rows:
                num_out[index] += len(row.output_ids)
                unsent_ids.add(index, row.output_ids)
                if not (row.text or row.HasField("finish_reason") or row.logprobs):
                    continue
                out = make()
                choice = out.choices.add(index=index, text=row.text)
                choice.token_ids.extend(unsent_ids.take(index))
                if not started[index]:
                    choice.prompt_token_ids.extend(prep.prompt_ids(index))
                    started[index] = True
                if prep.logprob.enabled:
                    choice.logprobs.CopyFrom(self._logprobs(row.input_token_logprobs, row.logprobs))
                if row.HasField("finish_reason"):
                    choice.finish_reason = finish_name(row.finish_reason)
                    set_matched_stop(choice, row.finish_reason, prep.eos_ids)
                    out.times.CopyFrom(row.times)
                    usages[index] = row.usage
                if continuous:
                    out.usage.CopyFrom(self.running_usage(prep.num_prompt_tokens, num_out))
                yield out
        if include_usage:
            last = make()
            last.usage.CopyFrom(self._usage(usages, prep.num_prompt_tokens, prep.n))
            yield last

    def _token_text(self, token_id: int) -> str:
        return self.logprobs.token_text(token_id)

    def _logprobs(
        self, prompt: Sequence[common_pb2.TokenLogprob], output: Sequence[common_pb2.TokenLogprob]
    ) -> openai_pb2.CompletionLogprobs:
        """``choice.logprobs``: with echo the prompt's entries come first (only echo asks
        for them with logprobs), the first prompt token's null; text offsets count from
        the start of the choice's text (the prompt's, with echo)."""
        out = self.logprobs.completion_entries([*prompt, *output])
        out.is_first_null = bool(prompt) and prompt[0].no_logprob
        return out

    @staticmethod
    def _usage(
        usages: Sequence[common_pb2.Usage | None], num_prompt: int, n: int
    ) -> openai_pb2.CompletionUsage:
        """Each prompt's tokens and cached tokens counted once (its first choice's: the
        other n - 1 share its KV, as vLLM counts a request), completions summed."""
        completion = sum(u.completion_tokens for u in usages if u is not None)
        firsts = [u for u in usages[::n] if u is not None]
        cached = sum(u.cached_tokens for u in firsts)
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


def _ask_prompt_logprobs(request: openai_pb2.CompletionRequest, logprob: LogprobRequest) -> None:
    """Prompt logprobs from the first token: for vLLM's prompt_logprobs (its count of
    alternatives), and for echo with logprobs (the logprobs count, as vLLM does)."""
    value = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
    top = prompt_logprobs_top(value, stream=request.stream)
    if top is None and request.echo and logprob.enabled:
        top = logprob.top
    if top is not None:
        logprob.start_len, logprob.prompt_top = 0, top
