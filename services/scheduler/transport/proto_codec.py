"""Protobuf <-> scheduler domain types (``Req``, ``ReqTimes``, ``FinishInfo``,
``OutputRow``): with the servicer and the pusher, the only scheduler modules that import
*_pb2, so the engine stays transport-free. A request is converted (and validated, by the
``EngineClient``) once, in the gRPC process, before it reaches the engine; rows are
converted from ``OutputRow`` snapshots in the gRPC process, where they are forwarded.
No function here reads a live ``Req``."""

from __future__ import annotations

from collections.abc import Iterable

from tokenline.v1 import common_pb2, scheduler_pb2

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.scheduler.core.output_row import OutputRow, RowInit
from services.scheduler.core.req import DecodeFlags, FinishInfo, Req, ReqTimes, SessionParams
from services.scheduler.model_executor.pooling import PoolingMethod, PoolingState
from services.scheduler.sampling.prompt_logprobs import PromptLogprob, PromptLogprobState
from services.scheduler.sampling.sampler import LogprobEntry

_FINISH_KINDS = {
    "stop": common_pb2.FinishReason.KIND_STOP,
    "length": common_pb2.FinishReason.KIND_LENGTH,
    "abort": common_pb2.FinishReason.KIND_ABORT,
}
_FINISH_NAMES = {kind: name for name, kind in _FINISH_KINDS.items()}
_POOLING_NAMES: dict[int, PoolingMethod] = {
    scheduler_pb2.PoolingParams.METHOD_LAST: "last",
    scheduler_pb2.PoolingParams.METHOD_MEAN: "mean",
    scheduler_pb2.PoolingParams.METHOD_CLS: "cls",
}


def req_from_pb(pb: scheduler_pb2.TokenizedGenerateReqInput) -> Req:
    params = SamplingParams.from_pb(pb.sampling_params)
    return Req(
        rid=pb.rid,
        input_ids=list(pb.input_ids),
        params=params,
        flags=DecodeFlags(
            reply_to=pb.reply_to,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            no_stop_trim=params.no_stop_trim,
            stop=tuple(params.stop),
        ),
        times=times_from_pb(pb.times),
        priority=pb.priority if pb.HasField("priority") else 0,
        return_logprob=pb.logprob.return_logprob,
        top_logprobs_num=pb.logprob.top_logprobs_num,
        label=pb.label,
        stream=pb.stream if pb.HasField("stream") else True,
        prompt_logprobs=prompt_logprobs_from_pb(pb),
        session=session_from_pb(pb),
        pooling=pooling_from_pb(pb),
    )


def pooling_from_pb(pb: scheduler_pb2.TokenizedGenerateReqInput) -> PoolingState | None:
    """A pooling request's method and normalisation; INVALID_ARGUMENT for no method."""
    if not pb.HasField("pooling"):
        return None
    method = _POOLING_NAMES.get(pb.pooling.method)
    if method is None:
        raise InvalidArgumentError("must be last, mean or cls", field="pooling.method")
    return PoolingState(method, pb.pooling.normalize)


def session_from_pb(pb: scheduler_pb2.TokenizedGenerateReqInput) -> SessionParams | None:
    if not pb.HasField("session_params"):
        return None
    s = pb.session_params
    return SessionParams(s.id, s.rid, s.offset, s.replace, s.drop_previous_output)


def prompt_logprobs_from_pb(
    pb: scheduler_pb2.TokenizedGenerateReqInput,
) -> PromptLogprobState | None:
    """What prompt logprobs the request asked for: none unless logprob_start_len is set;
    alternatives as many as prompt_top_logprobs_num, else top_logprobs_num."""
    opts = pb.logprob
    if not opts.HasField("logprob_start_len"):
        return None
    num_top = (
        opts.prompt_top_logprobs_num
        if opts.HasField("prompt_top_logprobs_num")
        else opts.top_logprobs_num
    )
    return PromptLogprobState.create(pb.input_ids, opts.logprob_start_len, num_top)


def prompt_logprob_to_pb(entry: PromptLogprob) -> common_pb2.TokenLogprob:
    """The first prompt token (no logprob) has ``no_logprob`` set and no rank."""
    top = [common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in entry.top]
    if entry.logprob is None:
        return common_pb2.TokenLogprob(token_id=entry.token_id, no_logprob=True)
    return common_pb2.TokenLogprob(
        token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank, top=top
    )


def times_from_pb(pb: common_pb2.StageTimes, *, with_own: bool = False) -> ReqTimes:
    """The stamps a client may bring (0 is unset), and with ``with_own`` the scheduler's
    own too (queued, ...): a row coming back from the engine process carries them all."""
    times = ReqTimes(
        received=pb.received or None,
        templated=pb.templated or None,
        tokenized=pb.tokenized or None,
        dispatched=pb.dispatched or None,
    )
    if with_own:
        times.queued = pb.queued or None
        times.scheduled = pb.scheduled or None
        times.first_token = pb.first_token or None
        times.finished = pb.finished or None
    return times


def times_to_pb(times: ReqTimes) -> common_pb2.StageTimes:
    """Every stamp reached; one never reached stays 0 (unset)."""
    return common_pb2.StageTimes(
        received=times.received or 0.0,
        templated=times.templated or 0.0,
        tokenized=times.tokenized or 0.0,
        dispatched=times.dispatched or 0.0,
        queued=times.queued or 0.0,
        scheduled=times.scheduled or 0.0,
        first_token=times.first_token or 0.0,
        finished=times.finished or 0.0,
    )


def finish_to_pb(finish: FinishInfo) -> common_pb2.FinishReason:
    pb = common_pb2.FinishReason(kind=_FINISH_KINDS[finish.kind], message=finish.message)
    if isinstance(finish.matched, str):
        pb.matched_str = finish.matched
    elif isinstance(finish.matched, int):
        pb.matched_token_id = finish.matched
    return pb


def finish_from_pb(pb: common_pb2.FinishReason) -> FinishInfo:
    matched_field = pb.WhichOneof("matched")
    matched = None if matched_field is None else getattr(pb, matched_field)
    return FinishInfo(_FINISH_NAMES[pb.kind], matched, pb.message)


def rows_to_pb(rows: Iterable[OutputRow]) -> scheduler_pb2.BatchTokenIDOutput:
    """One step's rows as the detokenizer takes them (the caller numbers the ``step``).
    Each row is written in place: making rows apart and copying them into the batch
    cost about twice as much."""
    batch = scheduler_pb2.BatchTokenIDOutput()
    write_rows(rows, batch)
    return batch


def write_rows(rows: Iterable[OutputRow], batch: scheduler_pb2.BatchTokenIDOutput) -> None:
    """Append ``rows`` to ``batch``, each written in place."""
    add = batch.rows.add
    for row in rows:
        _write_row(row, add())


def row_to_pb(row: OutputRow) -> scheduler_pb2.TokenIDRow:
    pb = scheduler_pb2.TokenIDRow()
    _write_row(row, pb)
    return pb


def _write_row(row: OutputRow, pb: scheduler_pb2.TokenIDRow) -> None:
    pb.rid = row.rid
    pb.new_token_ids.extend(row.new_token_ids)
    pb.prompt_tokens = row.num_prompt_tokens
    pb.completion_tokens = row.num_output_tokens
    pb.cached_tokens = row.num_cached_tokens
    if row.logprobs:
        pb.logprobs.extend(
            common_pb2.TokenLogprob(
                token_id=tok,
                logprob=lp,
                top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top],
            )
            for tok, lp, top in row.logprobs
        )
    if row.input_logprobs:
        pb.input_token_logprobs.extend(prompt_logprob_to_pb(e) for e in row.input_logprobs)
    if row.finish is not None:
        pb.finish_reason.CopyFrom(finish_to_pb(row.finish))
    if row.times is not None:
        pb.times.CopyFrom(times_to_pb(row.times))
    if row.embedding:
        pb.embedding.extend(row.embedding)
    if row.init is not None:
        flags = row.init.flags
        pb.has_init = True
        pb.reply_to = flags.reply_to
        pb.skip_special_tokens = flags.skip_special_tokens
        pb.spaces_between_special_tokens = flags.spaces_between_special_tokens
        pb.no_stop_trim = flags.no_stop_trim
        pb.stop.extend(flags.stop)
        pb.prompt_tail_ids.extend(row.init.prompt_tail_ids)


def row_from_pb(pb: scheduler_pb2.TokenIDRow) -> OutputRow:
    """The inverse of ``row_to_pb``: the gRPC process reads the engine process's rows
    with it (``engine_codec``, every step), and tests and tools. Built positionally, an
    empty repeated field skipped and a repeated scalar copied by a slice (made in C):
    keywords, generators and iterating each field had cost more than twice as much."""
    logprobs, input_logprobs, embedding = pb.logprobs, pb.input_token_logprobs, pb.embedding
    return OutputRow(
        pb.rid,
        tuple(pb.new_token_ids[:]),
        finish_from_pb(pb.finish_reason) if pb.HasField("finish_reason") else None,
        pb.prompt_tokens,
        pb.completion_tokens,
        pb.cached_tokens,
        tuple(map(_logprob_from_pb, logprobs)) if logprobs else (),
        times_from_pb(pb.times, with_own=True) if pb.HasField("times") else None,
        _init_from_pb(pb) if pb.has_init else None,
        tuple(map(_prompt_logprob_from_pb, input_logprobs)) if input_logprobs else (),
        tuple(embedding[:]) if embedding else (),
    )


def _init_from_pb(pb: scheduler_pb2.TokenIDRow) -> RowInit:
    flags = DecodeFlags(
        reply_to=pb.reply_to,
        skip_special_tokens=pb.skip_special_tokens,
        spaces_between_special_tokens=pb.spaces_between_special_tokens,
        no_stop_trim=pb.no_stop_trim,
        stop=tuple(pb.stop[:]),
    )
    return RowInit(flags, tuple(pb.prompt_tail_ids[:]))


def _logprob_from_pb(pb: common_pb2.TokenLogprob) -> LogprobEntry:
    return pb.token_id, pb.logprob, [(t.token_id, t.logprob) for t in pb.top]


def _prompt_logprob_from_pb(pb: common_pb2.TokenLogprob) -> PromptLogprob:
    top = tuple((t.token_id, t.logprob) for t in pb.top)
    if pb.no_logprob:
        return PromptLogprob(pb.token_id, None, 0, top)
    return PromptLogprob(pb.token_id, pb.logprob, pb.rank, top)
