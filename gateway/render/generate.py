"""GenerateResponse protos → SGLang's `/generate` JSON (the models in gateway/responses.py).

The proto stays what gRPC and Envoy clients get: each stream message carries what is
new. SGLang's HTTP server, by default (no `--incremental-streaming-output`), sends the
text, ids and logprobs *so far* in every frame, so a stream's renderer keeps each
output's totals; it is made per request and dies with it, so the gateway stays
stateless between requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tokenline.v1 import common_pb2, generate_pb2

from gateway import responses as out
from gateway.schemas import GenerateBody

# What vLLM and tokenline's OpenAI routes send for -inf: JSON has no infinity.
_MIN_LOGPROB = -9999.0
_KIND_NAMES: dict[int, Any] = {
    common_pb2.FinishReason.KIND_STOP: "stop",
    common_pb2.FinishReason.KIND_LENGTH: "length",
    common_pb2.FinishReason.KIND_ABORT: "abort",
}


@dataclass(frozen=True, slots=True)
class GenerateView:
    """What the client asked for that shapes the JSON: one object or a list, and which
    logprob keys."""

    is_single: bool
    return_logprob: bool = False
    top_logprobs_num: int = 0

    @classmethod
    def of(cls, body: GenerateBody, request: generate_pb2.GenerateReqInput) -> GenerateView:
        """SGLang's rule: one text (a string) or one id list (of ints) with n = 1 is a
        single request; a list of prompts, or n > 1, answers a list."""
        ids = body.input_ids
        is_one_prompt = isinstance(body.text, str) or bool(ids and isinstance(ids[0], int))
        n = request.sampling_params.n if request.sampling_params.HasField("n") else 1
        return cls(
            is_single=is_one_prompt and n <= 1,
            return_logprob=request.logprob.return_logprob,
            top_logprobs_num=request.logprob.top_logprobs_num,
        )


def _logprob(entry: Any) -> float | None:
    """None for the first prompt token (nothing before it, `no_logprob`), as SGLang."""
    if getattr(entry, "no_logprob", False) or math.isnan(entry.logprob):
        return None
    return entry.logprob if math.isfinite(entry.logprob) else _MIN_LOGPROB


def _triple(entry: Any) -> out.LogprobTriple:
    """(logprob, token id, text): text only where the frontend wrote it."""
    text = entry.text if entry.HasField("text") else None
    return (_logprob(entry), entry.token_id, text)


def _tops(entries: list[common_pb2.TokenLogprob]) -> list[list[out.LogprobTriple] | None]:
    return [[_triple(t) for t in e.top] for e in entries]


def input_logprobs(output: generate_pb2.GenerateOutput) -> list[common_pb2.TokenLogprob]:
    """The prompt's logprobs this output carries (SGLang's input_token_logprobs)."""
    return list(output.input_token_logprobs)


def finish_reason(finish: common_pb2.FinishReason, num_tokens: int) -> out.GenerateFinishReason:
    kind = _KIND_NAMES.get(finish.kind, "stop")
    if kind == "length":
        return out.GenerateFinishReason(type=kind, matched=None, length=num_tokens)
    if kind == "abort":
        return out.GenerateFinishReason(type=kind, matched=None, message=finish.message)
    which = finish.WhichOneof("matched")
    return out.GenerateFinishReason(type=kind, matched=getattr(finish, which) if which else None)


@dataclass(slots=True)
class _SoFar:
    """One output's totals while it streams."""

    text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    input_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)

    def add(self, output: generate_pb2.GenerateOutput) -> None:
        self.text.append(output.text)
        self.output_ids.extend(output.output_ids)
        self.logprobs.extend(output.logprobs)
        self.input_logprobs.extend(input_logprobs(output))


class GenerateRenderer:
    """Renders one request's response: ``whole`` for a unary answer, ``frame`` for each
    stream message (the frontend sends one output per message)."""

    def __init__(self, view: GenerateView) -> None:
        self.view = view
        self._so_far: dict[int, _SoFar] = {}

    def whole(self, response: generate_pb2.GenerateResponse) -> Any:
        outputs = []
        for output in response.outputs:
            totals = _SoFar()
            totals.add(output)
            outputs.append(self._render(output, totals).dump())
        return outputs[0] if self.view.is_single and len(outputs) == 1 else outputs

    def frame(self, response: generate_pb2.GenerateResponse) -> dict[str, Any]:
        output = response.outputs[0]
        totals = self._so_far.setdefault(output.index, _SoFar())
        totals.add(output)
        rendered = self._render(output, totals)
        if not self.view.is_single:
            rendered.index = output.index
        return rendered.dump()

    def _render(self, output: generate_pb2.GenerateOutput, totals: _SoFar) -> out.GenerateOutput:
        return out.GenerateOutput(
            text="".join(totals.text),
            output_ids=list(totals.output_ids),
            meta_info=self._meta_info(output, totals),
        )

    def _meta_info(
        self, output: generate_pb2.GenerateOutput, totals: _SoFar
    ) -> out.GenerateMetaInfo:
        meta = output.meta_info
        num_tokens = len(totals.output_ids)
        fields: dict[str, Any] = {}
        finish = None
        if output.HasField("finish_reason"):
            finish = finish_reason(output.finish_reason, num_tokens)
            fields = {"cached_tokens": meta.cached_tokens, "e2e_latency": meta.e2e_latency}
        if self.view.return_logprob:
            fields |= self._logprob_fields(totals)
        return out.GenerateMetaInfo(
            id=output.rid,
            finish_reason=finish,
            prompt_tokens=meta.prompt_tokens,
            completion_tokens=num_tokens,
            **fields,
        )

    def _logprob_fields(self, totals: _SoFar) -> dict[str, Any]:
        """SGLang's keys: the triples, and the top ones only when top_logprobs_num > 0."""
        fields: dict[str, Any] = {"output_token_logprobs": [_triple(e) for e in totals.logprobs]}
        if self.view.top_logprobs_num:
            fields["output_top_logprobs"] = _tops(totals.logprobs)
        fields["input_token_logprobs"] = [_triple(e) for e in totals.input_logprobs]
        if self.view.top_logprobs_num:
            fields["input_top_logprobs"] = _tops(totals.input_logprobs)
        return fields
