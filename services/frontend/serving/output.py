"""Pieces shared by every protocol's response assembly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenline.v1 import common_pb2, detokenizer_pb2, openai_pb2
from transformers import PreTrainedTokenizerBase

_FINISH_NAMES = {
    common_pb2.FinishReason.KIND_STOP: "stop",
    common_pb2.FinishReason.KIND_LENGTH: "length",
    common_pb2.FinishReason.KIND_ABORT: "abort",
}


def finish_name(fr: common_pb2.FinishReason) -> str:
    return _FINISH_NAMES.get(fr.kind, "stop")


def set_matched_stop(
    choice: object, fr: common_pb2.FinishReason, eos_ids: frozenset[int] = frozenset()
) -> None:
    """Copy what matched (vLLM's stop_reason) onto a choice proto; for an ``abort``
    finish, the reason the scheduler or detokenizer gave. A stop on one of ``eos_ids``
    (the model's own end tokens, not the request's stop_token_ids) sets nothing: vLLM
    reports an EOS stop as ``stop_reason: null``."""
    if fr.kind == common_pb2.FinishReason.KIND_ABORT:
        if fr.message:
            choice.matched_str = fr.message  # type: ignore[attr-defined]
        return
    which = fr.WhichOneof("matched")
    if which == "matched_token_id" and fr.matched_token_id in eos_ids:
        return
    if which is not None:
        setattr(choice, which, getattr(fr, which))


@dataclass(slots=True)
class ChoiceAccumulator:
    """Everything one choice produced, gathered for a non-streamed response."""

    chunks: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    input_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # prompt's
    finish: common_pb2.FinishReason | None = None
    usage: common_pb2.Usage | None = None
    times: common_pb2.StageTimes | None = None
    output_ids: list[int] = field(default_factory=list)

    def add(self, row: detokenizer_pb2.StrRow) -> None:
        self.output_ids.extend(row.output_ids)
        if row.text:
            self.chunks.append(row.text)
        self.logprobs.extend(row.logprobs)
        self.input_logprobs.extend(row.input_token_logprobs)
        if row.HasField("finish_reason"):
            self.finish = row.finish_reason
            self.usage = row.usage
            self.times = row.times

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def text(self) -> str:
        """Joined once, when the response is assembled."""
        return "".join(self.chunks)


class UnsentTokenIds:
    """vLLM's return_token_ids while streaming: each choice's ids not sent yet. A row
    whose text is all held back makes no chunk, so its ids ride on that choice's next
    one (its finish chunk at the latest): the chunks' token_ids join to the unary list."""

    def __init__(self, enabled: bool, num_choices: int) -> None:
        self.enabled = enabled
        self._pending: list[list[int]] = [[] for _ in range(num_choices)]

    def add(self, index: int, ids: Sequence[int]) -> None:
        if self.enabled:
            self._pending[index].extend(ids)

    def take(self, index: int) -> list[int]:
        ids, self._pending[index] = self._pending[index], []
        return ids


def usage_of(
    accs: Sequence[ChoiceAccumulator] | Sequence[common_pb2.Usage | None],
) -> openai_pb2.CompletionUsage:
    """Usage over the choices of one prompt, in choice order: the prompt and its cached
    tokens counted once (the first choice's: the others share its KV), completions summed."""
    found = [a.usage if isinstance(a, ChoiceAccumulator) else a for a in accs]
    usages = [u for u in found if u is not None]
    prompt = usages[0].prompt_tokens if usages else 0
    cached = usages[0].cached_tokens if usages else 0
    completion = sum(u.completion_tokens for u in usages)
    return openai_pb2.CompletionUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=openai_pb2.PromptTokensDetails(cached_tokens=cached),
    )


class LogprobFormatter:
    """Token ids -> OpenAI logprob entries (token text and its UTF-8 bytes)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def chat_entries(self, items: list[common_pb2.TokenLogprob]) -> openai_pb2.ChoiceLogprobs:
        entries = []
        for item in items:
            text = self.token_text(item.token_id)
            entries.append(
                openai_pb2.LogprobEntry(
                    token=text,
                    logprob=item.logprob,
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=[
                        openai_pb2.TopLogprobEntry(
                            token=(t := self.token_text(top.token_id)),
                            logprob=top.logprob,
                            bytes=list(t.encode("utf-8")),
                        )
                        for top in item.top
                    ],
                )
            )
        return openai_pb2.ChoiceLogprobs(content=entries)

    def completion_entries(
        self, items: list[common_pb2.TokenLogprob], text_start: int = 0
    ) -> openai_pb2.CompletionLogprobs:
        out = openai_pb2.CompletionLogprobs()
        offset = text_start
        for item in items:
            text = self.token_text(item.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(item.logprob)
            out.text_offset.append(offset)
            offset += len(text)
            top = out.top_logprobs.add()
            for t in item.top:
                top.fields[self.token_text(t.token_id)].number_value = t.logprob
        return out
