"""Drive a DetokenizerManager the way a scheduler does: one BatchTokenIDOutput per step."""

from __future__ import annotations

from collections.abc import Sequence

from tokenline.v1 import common_pb2, detokenizer_pb2, scheduler_pb2

from services.detokenizer.manager import DetokenizerManager

FRONTEND = "fe"
LENGTH = common_pb2.FinishReason(kind=common_pb2.FinishReason.KIND_LENGTH)
ABORT = common_pb2.FinishReason(kind=common_pb2.FinishReason.KIND_ABORT, message="client gone")


def stop_str(stop: str) -> common_pb2.FinishReason:
    return common_pb2.FinishReason(kind=common_pb2.FinishReason.KIND_STOP, matched_str=stop)


def stop_token(token_id: int) -> common_pb2.FinishReason:
    return common_pb2.FinishReason(
        kind=common_pb2.FinishReason.KIND_STOP, matched_token_id=token_id
    )


def row(
    rid: str,
    ids: Sequence[int],
    *,
    init: bool = False,
    finish: common_pb2.FinishReason | None = None,
    skip: bool = True,
    spaces: bool = True,
    stop: Sequence[str] = (),
    prompt_tail: Sequence[int] = (),
    no_stop_trim: bool = False,
    reply_to: str = FRONTEND,
) -> scheduler_pb2.TokenIDRow:
    """One row; the decode flags travel only on the first (``init``) row, as from a scheduler."""
    pb = scheduler_pb2.TokenIDRow(rid=rid, new_token_ids=list(ids))
    if init:
        pb.has_init = True
        pb.reply_to = reply_to
        pb.skip_special_tokens = skip
        pb.spaces_between_special_tokens = spaces
        pb.no_stop_trim = no_stop_trim
        pb.stop.extend(stop)
        pb.prompt_tail_ids.extend(prompt_tail)
    if finish is not None:
        pb.finish_reason.CopyFrom(finish)
    return pb


def push(
    manager: DetokenizerManager, *rows: scheduler_pb2.TokenIDRow, source: str = ""
) -> dict[str, list[detokenizer_pb2.StrRow]]:
    routed = manager.handle_batch(scheduler_pb2.BatchTokenIDOutput(rows=list(rows)), source)
    return {frontend_id: list(batch.rows) for frontend_id, batch in routed.items()}


def stream(
    manager: DetokenizerManager,
    chunks: Sequence[Sequence[int]],
    finish: common_pb2.FinishReason = LENGTH,
    rid: str = "r",
    **init: object,
) -> list[str]:
    """Feed ``chunks`` as the steps of one request; the last step finishes. Returns each delta."""
    deltas = []
    for i, ids in enumerate(chunks):
        last = i == len(chunks) - 1
        rows = push(manager, row(rid, ids, init=i == 0, finish=finish if last else None, **init))
        deltas += [r.text for r in rows.get(str(init.get("reply_to", FRONTEND)), [])]
    return deltas
