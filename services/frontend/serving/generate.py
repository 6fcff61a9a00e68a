"""The native generate API: text or ids, single or batch, results in input order.

Output ``index`` ``j * n + i`` is choice i of input j; its ``rid`` echoes the
client's: ``<rid>-<j>`` for batch element j (``<rid>-<j>-<i>`` with n > 1). Inside
the cluster each choice has a frontend-made rid of its own; a request in a session
answers with that rid instead, since it is the key a later request of the session
names its parent by (``session_params.rid``). A streamed output carries
its token counts so far on every frame; cached tokens and ``e2e_latency`` come with
the final one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from tokenline.v1 import common_pb2, generate_pb2, session_pb2

from services.common.errors import InvalidArgumentError
from services.frontend.dispatch.tokenizer_manager import TokenizedRequest
from services.frontend.serving.base import LogprobRequest, ServingBase, new_times
from services.frontend.serving.output import ChoiceAccumulator
from services.frontend.validation.params import check_sampling, params_from_native
from services.frontend.validation.prompt_logprobs import MAX_PROMPT_LOGPROBS, add_token_texts


class GenerateServing(ServingBase):
    async def prepare(self, request: generate_pb2.GenerateReqInput) -> list[TokenizedRequest]:
        times = new_times()
        if request.text and request.input_ids:
            raise InvalidArgumentError("give text or input_ids, not both", field="text")
        self.check_generates()
        requested = params_from_native(request.sampling_params, self.ctx.sampling_defaults)
        check_sampling(requested, self.limits)
        await self.ctx.grammars.check(requested.params, requested.aliases)
        logprob = LogprobRequest(request.logprob.return_logprob, request.logprob.top_logprobs_num)
        self.check_logprobs(logprob, field="top_logprobs_num")
        _ask_prompt_logprobs(request.logprob, logprob)
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
        reqs = self.build_requests(label, requested, id_lists, field, logprob, times)
        if request.HasField("session_params"):
            reqs = self._in_session(request.session_params, reqs)
        return reqs

    def _in_session(
        self, session: session_pb2.SessionParams, reqs: list[TokenizedRequest]
    ) -> list[TokenizedRequest]:
        """One prompt and one choice, bound for the replica that holds the session (which
        checks the rest: the parent, replace, capacity). The prompt's ids are the new
        tokens only, so its context is checked there too, once the parent's are added."""
        if len(reqs) != 1:
            raise InvalidArgumentError(
                "a request in a session takes one prompt and n = 1", field="session_params"
            )
        if session.offset < 0:
            raise InvalidArgumentError(
                f"must be >= 0, got {session.offset}", field="session_params.offset"
            )
        self.manager.sessions.scheduler_of(session.id)  # refuses an unknown session now
        return [dataclasses.replace(reqs[0], session=session)]

    async def complete(
        self, request: generate_pb2.GenerateReqInput
    ) -> generate_pb2.GenerateResponse:
        reqs = await self.prepare(request)
        accs = await self.collect(reqs)
        outputs = [
            _output(_output_rid(r), i, acc)
            for i, (r, acc) in enumerate(zip(reqs, accs, strict=True))
        ]
        if request.return_text_in_logprobs:
            for out in outputs:
                self._add_token_texts(out)
        return generate_pb2.GenerateResponse(outputs=outputs)

    def _add_token_texts(self, out: generate_pb2.GenerateOutput) -> None:
        """SGLang's return_text_in_logprobs: each entry (output and prompt) and its top
        entries get their text."""
        add_token_texts(out.logprobs, self.logprobs.token_text)
        add_token_texts(out.input_token_logprobs, self.logprobs.token_text)

    async def stream(
        self, request: generate_pb2.GenerateReqInput
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        reqs = await self.prepare(request)
        num_out = [0] * len(reqs)
        async with aclosing(self.manager.generate(reqs)) as rows:
            async for index, row in rows:
                num_out[index] += len(row.output_ids)
                out = generate_pb2.GenerateOutput(
                    rid=_output_rid(reqs[index]),
                    index=index,
                    text=row.text,
                    output_ids=row.output_ids,
                    logprobs=row.logprobs,
                    input_token_logprobs=row.input_token_logprobs,
                )
                out.meta_info.prompt_tokens = len(reqs[index].input_ids)
                out.meta_info.completion_tokens = num_out[index]
                if request.return_text_in_logprobs:
                    self._add_token_texts(out)
                if row.HasField("finish_reason"):
                    _finish(out, row.finish_reason, row.usage, row.times)
                yield generate_pb2.GenerateResponse(outputs=[out])


def _output_rid(req: TokenizedRequest) -> str:
    """The output's ``rid``: the client's label, or in a session the cluster rid."""
    return req.rid if req.session is not None else req.label


def _output(rid: str, index: int, acc: ChoiceAccumulator) -> generate_pb2.GenerateOutput:
    out = generate_pb2.GenerateOutput(
        rid=rid,
        index=index,
        text=acc.text,
        output_ids=acc.output_ids,
        logprobs=acc.logprobs,
        input_token_logprobs=acc.input_logprobs,
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
    e2e_latency = time.time() - times.received if times and times.received else 0.0
    out.meta_info.CopyFrom(
        generate_pb2.MetaInfo(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            times=times,
            e2e_latency=max(0.0, e2e_latency),
        )
    )


def _ask_prompt_logprobs(opts: common_pb2.LogprobOptions, logprob: LogprobRequest) -> None:
    """SGLang's logprob_start_len (-1, its default, asks for none); the alternatives per
    prompt position are prompt_top_logprobs_num when set, else top_logprobs_num."""
    if not opts.HasField("logprob_start_len") or opts.logprob_start_len == -1:
        return
    if not opts.return_logprob:
        raise InvalidArgumentError("requires return_logprob", field="logprob_start_len")
    top = opts.prompt_top_logprobs_num if opts.HasField("prompt_top_logprobs_num") else logprob.top
    if not 0 <= top <= MAX_PROMPT_LOGPROBS:
        raise InvalidArgumentError(
            f"must be in [0, {MAX_PROMPT_LOGPROBS}], got {top}", field="prompt_top_logprobs_num"
        )
    logprob.start_len, logprob.prompt_top = opts.logprob_start_len, top
