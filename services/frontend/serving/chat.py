"""Chat completions: template, tokenize, fan out n choices, assemble OpenAI output
(reasoning and tool calls read by the parsers in ``chat_output.py``)."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from tokenline.v1 import common_pb2, detokenizer_pb2, openai_pb2

from services.common.errors import InvalidArgumentError, UnavailableError
from services.frontend.chat.messages import ChatInput, chat_input
from services.frontend.chat.template import ChatTemplate
from services.frontend.dispatch.tokenizer_manager import TokenizedRequest
from services.frontend.serving.base import LogprobRequest, ServingBase, new_times
from services.frontend.serving.chat_output import (
    ChatParsing,
    ChatPieces,
    fill_delta,
    fill_message,
    set_reasoning_tokens,
)
from services.frontend.serving.output import UnsentTokenIds, set_matched_stop, usage_of
from services.frontend.serving.tool_choice import ReasoningLead, plan_tool_calls
from services.frontend.validation.prompt_logprobs import prompt_logprobs_top, with_texts


@dataclass(slots=True)
class PreparedChat:
    label: str  # the client's id: the response id is chatcmpl-<label>
    reqs: list[TokenizedRequest]
    logprob: LogprobRequest
    parsing: ChatParsing
    eos_ids: frozenset[int] = frozenset()  # stops on these report no stop_reason
    return_token_ids: bool = False

    @property
    def prompt_ids(self) -> list[int]:
        """What return_token_ids reports as prompt_token_ids (none when not asked)."""
        return self.reqs[0].input_ids if self.return_token_ids else []


class ChatServing(ServingBase):
    async def prepare(self, request: openai_pb2.ChatCompletionRequest) -> PreparedChat:
        times = new_times()
        max_completion = (
            request.max_completion_tokens if request.HasField("max_completion_tokens") else None
        )
        requested = self.openai_params(request, max_completion)
        top = request.top_logprobs if request.HasField("top_logprobs") else 0
        logprob = LogprobRequest(request.logprobs, top)
        self.check_logprobs(logprob)
        value = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        prompt_top = prompt_logprobs_top(value, stream=request.stream)
        if prompt_top is not None:  # vLLM's prompt_logprobs: every prompt position
            logprob.start_len, logprob.prompt_top = 0, prompt_top
        template = self._template()
        chat = chat_input(request, template.content_format)
        ids = await self._tokenize(template, chat, times, request.add_special_tokens)
        lead = self._reasoning_lead(chat, ids)
        tools = await plan_tool_calls(
            chat, requested, self.ctx.tool_parser, lead, self.ctx.tool_grammars
        )
        await self.ctx.grammars.check(requested.params, requested.aliases)
        label = self.new_label(request.request_id)
        reqs = self.build_requests(label, requested, [ids], "messages", logprob, times)
        parsing = ChatParsing(self.ctx.reasoning_parser, lead == "required", tools)
        eos_ids = self.eos_ids(requested)
        return PreparedChat(label, reqs, logprob, parsing, eos_ids, request.return_token_ids)

    async def prompt_ids(self, request: openai_pb2.ChatCompletionRequest) -> list[int]:
        """The prompt ids this conversation would run with (the tokenize endpoints): the
        same template call and tokenization as a chat request."""
        template = self._template()
        chat = chat_input(request, template.content_format)
        return await self._tokenize(template, chat, new_times())

    def _reasoning_lead(self, chat: ChatInput, prompt_ids: list[int]) -> ReasoningLead:
        """Whether the output starts inside a reasoning block ("required"), may open one
        ("optional"), or has none: from the prompt's last tokens and the template switches."""
        parser = self.ctx.reasoning_parser
        if parser is None:
            return "none"
        tail = self._decode(prompt_ids[-8:])
        return "required" if parser.starts_inside(tail, chat.kwargs) else "optional"

    def _template(self) -> ChatTemplate:
        if self.ctx.chat_template is None:
            raise UnavailableError("this model has no chat template; use completions")
        return self.ctx.chat_template

    async def _tokenize(
        self,
        template: ChatTemplate,
        chat: ChatInput,
        times: common_pb2.StageTimes,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The template writes BOS and every control token itself; vLLM's
        ``add_special_tokens: true`` adds the tokenizer's on top of the rendered text."""
        if template.tokenizes_in_template:
            if add_special_tokens:
                raise InvalidArgumentError(
                    "not supported while the frontend tokenizes inside the chat template "
                    "(--chat-tokenization template)",
                    field="add_special_tokens",
                )
            ids = await self.ctx.batcher.run(functools.partial(template.tokenize, chat))
            times.templated = times.tokenized = time.time()
            return ids
        prompt = template.render(chat)
        times.templated = time.time()
        ids = await self.ctx.batcher.encode(prompt, add_special_tokens)
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
            prompt_token_ids=prep.prompt_ids,
        )
        num_reasoning = 0
        for i, acc in enumerate(accs):
            parser = prep.parsing.new_choice()
            pieces = parser.parse(acc.text)
            finish = acc.finish or common_pb2.FinishReason()
            choice = response.choices.add(index=i, finish_reason=parser.finish_reason(finish))
            fill_message(choice.message, pieces, prep.parsing.reads_reasoning)
            num_reasoning += parser.num_reasoning_tokens(acc.output_ids, self._decode)
            set_matched_stop(choice, finish, prep.eos_ids)
            if prep.return_token_ids:
                choice.token_ids.extend(acc.output_ids)
            if prep.logprob.enabled:
                choice.logprobs.CopyFrom(self.logprobs.chat_entries(acc.logprobs))
        if prep.parsing.reads_reasoning:
            set_reasoning_tokens(response.usage, num_reasoning)
        if request.HasField("prompt_logprobs") and accs:  # the choices share the prompt
            response.prompt_logprobs.extend(with_texts(accs[0].input_logprobs, self._token_text))
        if accs and accs[0].times is not None:
            response.times.CopyFrom(accs[0].times)
        return response

    def _token_text(self, token_id: int) -> str:
        return self.logprobs.token_text(token_id)

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _fill_choice(
        self,
        choice: openai_pb2.ChatChunkChoice,
        pieces: ChatPieces,
        row: detokenizer_pb2.StrRow,
        logprob: LogprobRequest,
        token_ids: list[int],
    ) -> None:
        fill_delta(choice.delta, pieces)
        choice.token_ids.extend(token_ids)
        if logprob.enabled:
            choice.logprobs.CopyFrom(self.logprobs.chat_entries(list(row.logprobs)))

    async def stream(
        self, request: openai_pb2.ChatCompletionRequest
    ) -> AsyncGenerator[openai_pb2.ChatCompletionChunk, None]:
        if request.HasField("prompt_logprobs"):  # a stream has no place for them
            prompt_logprobs_top(request.prompt_logprobs, stream=True)
        prep = await self.prepare(request)
        chunks = _ChunkMaker(prep.label, self.model_name, int(time.time()), prep.eos_ids)
        include_usage = request.stream_options.include_usage
        # vLLM's rule: per-chunk usage only when usage was asked for at all.
        continuous = include_usage and request.stream_options.continuous_usage_stats
        num_prompt = len(prep.reqs[0].input_ids)
        usages: list[common_pb2.Usage | None] = [None] * len(prep.reqs)  # in choice order
        num_out = [0] * len(prep.reqs)
        unsent_ids = UnsentTokenIds(prep.return_token_ids, len(prep.reqs))
        parsers = [prep.parsing.new_choice() for _ in prep.reqs]
        output_ids: list[list[int]] = [[] for _ in prep.reqs]  # for reasoning_tokens
        num_reasoning = 0
        async with self.manager.open(prep.reqs) as rows:
            # Only once every choice is accepted.
            yield chunks.role_chunk(len(prep.reqs), prep.prompt_ids)
            async for index, row in rows:
                num_out[index] += len(row.output_ids)
                unsent_ids.add(index, row.output_ids)
                usage = self.running_usage(num_prompt, num_out) if continuous else None
                parser, finished = parsers[index], row.HasField("finish_reason")
                pieces = parser.feed(row.text)
                if finished:
                    pieces.extend(parser.finish())
                if pieces or row.logprobs:
                    out = chunks.make(usage)
                    choice, ids = out.choices.add(index=index), unsent_ids.take(index)
                    self._fill_choice(choice, pieces, row, prep.logprob, ids)
                    yield out
                if prep.parsing.reads_reasoning:
                    output_ids[index] += row.output_ids
                if finished:
                    usages[index] = row.usage
                    num_reasoning += parser.num_reasoning_tokens(output_ids[index], self._decode)
                    reason = parser.finish_reason(row.finish_reason)
                    done = chunks.finish_chunk(index, row.finish_reason, reason, usage)
                    done.choices[0].token_ids.extend(unsent_ids.take(index))
                    done.times.CopyFrom(row.times)
                    yield done
        if include_usage:
            final = usage_of(usages)
            if prep.parsing.reads_reasoning:
                set_reasoning_tokens(final, num_reasoning)
            yield chunks.make(final)


@dataclass(frozen=True, slots=True)
class _ChunkMaker:
    label: str
    model: str
    created: int
    eos_ids: frozenset[int] = frozenset()

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

    def role_chunk(self, num_choices: int, prompt_ids: list[int]) -> openai_pb2.ChatCompletionChunk:
        chunk = self.make()
        chunk.prompt_token_ids.extend(prompt_ids)
        for i in range(num_choices):
            chunk.choices.add(index=i).delta.MergeFrom(
                openai_pb2.ChatDelta(role="assistant", content="")
            )
        return chunk

    def finish_chunk(
        self,
        index: int,
        finish: common_pb2.FinishReason,
        reason: str,
        usage: openai_pb2.CompletionUsage | None,
    ) -> openai_pb2.ChatCompletionChunk:
        chunk = self.make(usage)
        done = chunk.choices.add(index=index, finish_reason=reason)
        done.delta.SetInParent()
        set_matched_stop(done, finish, self.eos_ids)
        return chunk
