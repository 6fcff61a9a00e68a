"""ReqState: the frontend's record of one in-flight rid, and the table of them.

One ``ReqStage`` says where a choice stands with its scheduler, and so whether the
scheduler may hold the rid (and an ending must send an AbortReq):

    CREATED -> SENT -> RECEIVING -> FINISHED          (its final row arrived)
                 |         |
                 |         +------> FAILED -> ABORTED  (a service was lost; abort sent)
                 +-> REFUSED                           (AddRequest refused: never held)
    SENT / RECEIVING / FAILED -> ABORTED               (the client went away; abort sent)

``SENT`` starts before AddRequest goes out, since the scheduler may hold the rid from
then on even if the reply never arrives; ``error`` is set exactly when it is FAILED.

Rows are not queued one by one: each state gathers what arrived since its
consumer last looked and the shared ``ChoiceNews`` only says which choice has news. A
consumer that falls behind therefore gets one coalesced row per choice, each text
piece joined exactly once; one that keeps up gets each row as the detokenizer sent it,
uncopied (the usual case: one row per step).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from tokenline.v1 import common_pb2, detokenizer_pb2

from services.common.errors import AlreadyExistsError


class ReqStage(enum.Enum):
    CREATED = "created"  # not sent to a scheduler
    SENT = "sent"  # AddRequest sent: the scheduler may hold the rid
    REFUSED = "refused"  # AddRequest refused: the scheduler never held it
    RECEIVING = "receiving"  # rows are arriving
    FINISHED = "finished"  # its final row arrived: the scheduler released it
    FAILED = "failed"  # ended here (``error``) while the scheduler may still hold it
    ABORTED = "aborted"  # an AbortReq was sent for it


_HELD = frozenset({ReqStage.SENT, ReqStage.RECEIVING, ReqStage.FAILED})
_OVER = frozenset({ReqStage.REFUSED, ReqStage.FINISHED, ReqStage.FAILED, ReqStage.ABORTED})


class ChoiceNews:
    """Which choices of one client request have news, for the one consumer of them.

    A list and a future instead of an ``asyncio.Queue``: it runs for every streamed
    token, and the queue looked its loop up (a ``getpid`` system call) on every get.
    """

    __slots__ = ("_loop", "_indices", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._indices: list[int] = []
        self._waiter: asyncio.Future[None] | None = None

    def post(self, index: int) -> None:
        self._indices.append(index)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def pending(self) -> list[int]:
        """The indices posted so far, in order; nothing is taken."""
        return list(self._indices)

    async def take(self) -> list[int]:
        """Wait for news, then every index posted since the last take, in order."""
        while not self._indices:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        indices, self._indices = self._indices, []
        return indices


@dataclass(slots=True, eq=False)
class ReqState:
    """One choice of one client request, from before dispatch until removal."""

    rid: str
    index: int
    sink: ChoiceNews
    label: str = ""  # the client's id for this choice, for logs
    owner: str = ""  # the name of the API key it was made with ("" without keys)
    times: common_pb2.StageTimes = field(default_factory=common_pb2.StageTimes)
    stage: ReqStage = ReqStage.CREATED
    scheduler: str = ""
    dispatch_call: asyncio.Future | None = None  # the AddRequest call while in flight
    error: str | None = None  # why it FAILED: a service it needed was lost (UNAVAILABLE)
    rows: list[detokenizer_pb2.StrRow] = field(default_factory=list)  # since the last take
    final: detokenizer_pb2.StrRow | None = None
    is_pending: bool = False  # has news the consumer has not taken

    @property
    def may_be_held(self) -> bool:
        """The scheduler may still run it: an ending needs an AbortReq (once)."""
        return self.stage in _HELD

    @property
    def is_over(self) -> bool:
        """Nothing more reaches the consumer; later rows are ignored."""
        return self.stage in _OVER

    def push(self, row: detokenizer_pb2.StrRow) -> None:
        """Gather one row from the detokenizer; rows after the end are ignored."""
        if self.is_over:
            return
        if not self.times.first_token:
            self.times.first_token = time.time()
        self.stage = ReqStage.RECEIVING
        self.rows.append(row)
        if row.HasField("finish_reason"):
            self.final = row
            self.times.finished = time.time()
            self.stage = ReqStage.FINISHED
        self._notify()

    def fail(self, message: str) -> None:
        """End a request the scheduler may still hold, from the frontend's side."""
        if self.is_over or not self.may_be_held:
            return
        self.error = message
        self.stage = ReqStage.FAILED
        self._notify()

    def take(self) -> detokenizer_pb2.StrRow:
        """Everything gathered since the last take, as one row. Rows are shared, not
        copied: a consumer reads them and never changes them."""
        rows, self.rows = self.rows, []
        self.is_pending = False
        if len(rows) == 1 and self.final is None:
            return rows[0]  # a non-final row carries nothing to merge
        row = detokenizer_pb2.StrRow(rid=self.rid, text="".join(r.text for r in rows))
        for r in rows:
            row.output_ids.extend(r.output_ids)
            row.logprobs.extend(r.logprobs)
            row.input_token_logprobs.extend(r.input_token_logprobs)
        if self.final is not None:
            row.finish_reason.CopyFrom(self.final.finish_reason)
            row.usage.CopyFrom(self.final.usage)
            row.times.CopyFrom(merged_times(self.times, self.final.times))
            row.embedding.extend(self.final.embedding)
        return row

    def _notify(self) -> None:
        if not self.is_pending:
            self.is_pending = True
            self.sink.post(self.index)


def merged_times(
    local: common_pb2.StageTimes, remote: common_pb2.StageTimes
) -> common_pb2.StageTimes:
    """The scheduler's stamps where it set them; the frontend's own for the rest."""
    out = common_pb2.StageTimes()
    out.CopyFrom(local)
    for desc, value in remote.ListFields():
        if value:
            setattr(out, desc.name, value)
    return out


class ReqStateTable:
    """rid -> ReqState for this frontend; one owner, refuses duplicate in-flight rids."""

    def __init__(self) -> None:
        self._states: dict[str, ReqState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def create_all(
        self, rids: list[str], sink: ChoiceNews, times: common_pb2.StageTimes
    ) -> list[ReqState]:
        """All of a client request's states, or none of them (ALREADY_EXISTS)."""
        taken = [rid for rid in rids if rid in self._states]
        if taken or len(set(rids)) != len(rids):
            raise AlreadyExistsError(
                f"request id {(taken or rids)[0]!r} is already in flight", field="rid"
            )
        states = []
        for index, rid in enumerate(rids):
            own_times = common_pb2.StageTimes()
            own_times.CopyFrom(times)
            states.append(ReqState(rid=rid, index=index, sink=sink, times=own_times))
        self._states.update((s.rid, s) for s in states)
        return states

    def live(self) -> list[ReqState]:
        return list(self._states.values())

    def get(self, rid: str) -> ReqState | None:
        return self._states.get(rid)

    def remove(self, state: ReqState) -> None:
        """Drop ``state`` if it is still the one registered for its rid."""
        if self._states.get(state.rid) is state:
            del self._states[state.rid]
