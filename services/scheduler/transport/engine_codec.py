"""The engine boundary's messages (``core/messages.py``) as Protobuf (``engine.proto``),
for the pipe between the scheduler's gRPC process and its engine process. Every
function here is one direction of one message; ``proto_codec.py`` does requests and rows."""

from __future__ import annotations

from tokenline.v1 import engine_pb2, scheduler_pb2

from services.common.errors import TokenlineError
from services.scheduler.core.messages import (
    NO_TICKET,
    AbortCommand,
    AbortOwnedCommand,
    AbortStartedCommand,
    AddCommand,
    Answer,
    CloseSessionCommand,
    Command,
    EngineLimits,
    EngineOutput,
    EngineStats,
    FlushCommand,
    FlushOutcome,
    OpenSessionCommand,
    Runner,
)
from services.scheduler.core.stats import FinishedReqStats, SchedulerStats
from services.scheduler.transport.proto_codec import req_from_pb, req_to_pb

# The refusals an answer may carry, by class name (services/common/errors.py).
_ERRORS: dict[str, type[TokenlineError]] = {
    cls.__name__: cls for cls in (TokenlineError, *TokenlineError.__subclasses__())
}


def encode_command(command: Command | None) -> bytes:
    """``None`` is the stop command."""
    pb = engine_pb2.EngineCommand()
    if command is None:
        pb.stop = True
    elif isinstance(command, AddCommand):
        pb.ticket = command.ticket
        pb.add.CopyFrom(req_to_pb(command.req))
    elif isinstance(command, AbortCommand):
        pb.abort.rid, pb.abort.reason = command.rid, command.reason
    elif isinstance(command, AbortStartedCommand):
        pb.abort_started = command.reason
    elif isinstance(command, AbortOwnedCommand):
        pb.abort_owned.owner, pb.abort_owned.reason = command.owner, command.reason
    elif isinstance(command, FlushCommand):
        pb.ticket = command.ticket
        pb.flush.SetInParent()
    elif isinstance(command, OpenSessionCommand):
        pb.ticket = command.ticket
        pb.open_session.session_id = command.session_id
        pb.open_session.capacity_of_str_len = command.capacity
        pb.open_session.owner = command.owner
    else:
        pb.ticket = command.ticket
        pb.close_session.session_id = command.session_id
    return pb.SerializeToString()


def decode_command(data: bytes) -> Command | None:
    pb = engine_pb2.EngineCommand.FromString(data)
    kind = pb.WhichOneof("command")
    if kind == "add":
        req = req_from_pb(pb.add)
        req.times.queued = pb.add.times.queued or None  # stamped on acceptance
        return AddCommand(req, pb.ticket)
    if kind == "abort":
        return AbortCommand(pb.abort.rid, pb.abort.reason)
    if kind == "abort_started":
        return AbortStartedCommand(pb.abort_started)
    if kind == "abort_owned":
        return AbortOwnedCommand(pb.abort_owned.owner, pb.abort_owned.reason)
    if kind == "flush":
        return FlushCommand(pb.ticket)
    if kind == "open_session":
        s = pb.open_session
        return OpenSessionCommand(s.session_id, s.capacity_of_str_len, s.owner, pb.ticket)
    if kind == "close_session":
        return CloseSessionCommand(pb.close_session.session_id, pb.ticket)
    return None  # stop


def encode_ready(limits: EngineLimits, dtype: str) -> bytes:
    ready = engine_pb2.EngineReady(
        vocab_size=limits.vocab_size,
        context_length=limits.context_length,
        num_kv_tokens=limits.num_kv_tokens,
        max_waiting_requests=limits.max_waiting_requests,
        dtype=dtype,
        runner=limits.runner,
        hidden_size=limits.hidden_size,
    )
    return engine_pb2.EngineOutput(ready=ready).SerializeToString()


def decode_ready(data: bytes) -> tuple[EngineLimits, str]:
    """The engine's limits and the dtype its model runs in, from its first message."""
    ready = engine_pb2.EngineOutput.FromString(data).ready
    runner: Runner = "pooling" if ready.runner == "pooling" else "generate"
    limits = EngineLimits(
        ready.vocab_size,
        ready.context_length,
        ready.num_kv_tokens,
        ready.max_waiting_requests,
        runner=runner,
        hidden_size=ready.hidden_size,
    )
    return limits, ready.dtype


def encode_output(output: EngineOutput) -> bytes:
    s = output.engine_stats
    pb = engine_pb2.EngineOutput(
        gauges=engine_pb2.EngineGauges(
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            num_free_kv_tokens=s.num_free_kv_tokens,
            num_total_kv_tokens=s.num_total_kv_tokens,
            num_cached_kv_tokens=s.num_cached_kv_tokens,
            num_evictable_kv_tokens=s.num_evictable_kv_tokens,
            num_sessions=s.num_sessions,
        ),
        idle=output.idle,
        num_applied=output.num_applied,
        answers=[_answer_to_pb(ticket, answer) for ticket, answer in output.answers],
        rows=output.rows,
    )
    if output.stats is not None:
        pb.stats.CopyFrom(_stats_to_pb(output.stats))
    return pb.SerializeToString()


def decode_output(data: bytes) -> EngineOutput:
    pb = engine_pb2.EngineOutput.FromString(data)
    g = pb.gauges
    gauges = EngineStats(
        num_waiting=g.num_waiting,
        num_running=g.num_running,
        num_free_kv_tokens=g.num_free_kv_tokens,
        num_total_kv_tokens=g.num_total_kv_tokens,
        num_cached_kv_tokens=g.num_cached_kv_tokens,
        num_evictable_kv_tokens=g.num_evictable_kv_tokens,
        num_sessions=g.num_sessions,
    )
    return EngineOutput(
        engine_stats=gauges,
        idle=pb.idle,
        num_applied=pb.num_applied,
        answers=tuple((a.ticket, _answer_from_pb(a)) for a in pb.answers),
        rows=tuple(pb.rows),
        stats=_stats_from_pb(pb.stats) if pb.HasField("stats") else None,
    )


def _answer_to_pb(ticket: int, answer: Answer) -> engine_pb2.EngineAnswer:
    assert ticket != NO_TICKET, "an answer to a command nobody waits on"
    pb = engine_pb2.EngineAnswer(ticket=ticket)
    if isinstance(answer, TokenlineError):
        pb.error.kind = type(answer).__name__
        pb.error.message = answer.message
        pb.error.field = answer.field or ""
    elif isinstance(answer, FlushOutcome):
        pb.flush.CopyFrom(
            scheduler_pb2.FlushCacheResult(
                flushed=answer.flushed,
                num_running=answer.num_running,
                num_waiting=answer.num_waiting,
                reason=answer.reason,
            )
        )
    else:
        pb.done = True
    return pb


def _answer_from_pb(pb: engine_pb2.EngineAnswer) -> Answer:
    kind = pb.WhichOneof("answer")
    if kind == "error":
        error_type = _ERRORS.get(pb.error.kind, TokenlineError)
        return error_type(pb.error.message, field=pb.error.field or None)
    if kind == "flush":
        f = pb.flush
        return FlushOutcome(f.flushed, f.num_running, f.num_waiting, f.reason)
    return None


def _stats_to_pb(stats: SchedulerStats) -> engine_pb2.EngineStepStats:
    return engine_pb2.EngineStepStats(
        num_prompt_tokens=stats.num_prompt_tokens,
        num_generation_tokens=stats.num_generation_tokens,
        num_prefix_cache_queries=stats.num_prefix_cache_queries,
        num_prefix_cache_hits=stats.num_prefix_cache_hits,
        num_retractions=stats.num_retractions,
        step_tokens=stats.step_tokens,
        time_to_first_token_s=stats.time_to_first_token_s,
        inter_token_latency_s=stats.inter_token_latency_s,
        finished=[
            engine_pb2.FinishedReqStats(
                finish_reason=f.finish_reason,
                num_prompt_tokens=f.num_prompt_tokens,
                num_generation_tokens=f.num_generation_tokens,
                e2e_s=f.e2e_s,
                queue_s=f.queue_s,
                prefill_s=f.prefill_s,
                decode_s=f.decode_s,
            )
            for f in stats.finished
        ],
    )


def _stats_from_pb(pb: engine_pb2.EngineStepStats) -> SchedulerStats:
    return SchedulerStats(
        num_prompt_tokens=pb.num_prompt_tokens,
        num_generation_tokens=pb.num_generation_tokens,
        num_prefix_cache_queries=pb.num_prefix_cache_queries,
        num_prefix_cache_hits=pb.num_prefix_cache_hits,
        num_retractions=pb.num_retractions,
        step_tokens=list(pb.step_tokens),
        time_to_first_token_s=list(pb.time_to_first_token_s),
        inter_token_latency_s=list(pb.inter_token_latency_s),
        finished=[
            FinishedReqStats(
                finish_reason=f.finish_reason,
                num_prompt_tokens=f.num_prompt_tokens,
                num_generation_tokens=f.num_generation_tokens,
                e2e_s=f.e2e_s,
                queue_s=f.queue_s if f.HasField("queue_s") else None,
                prefill_s=f.prefill_s if f.HasField("prefill_s") else None,
                decode_s=f.decode_s if f.HasField("decode_s") else None,
            )
            for f in pb.finished
        ],
    )
