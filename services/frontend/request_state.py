"""ReqState: the frontend's record of one in-flight rid, and the table of them.

Lifecycle, forward only: created -> dispatched -> receiving -> finished -> removed.
``dispatched`` says the scheduler may hold the rid (set before AddRequest is
sent, cleared if it answers with an error), so it decides whether an ending
needs an AbortReq; ``abort_sent`` makes that abort happen at most once.

Rows are not queued one by one: each state gathers what arrived since its
consumer last looked (text as chunks, ids, logprobs) and the shared ``sink``
only says which choice has news. A consumer that falls behind therefore gets
one coalesced row per choice, and each text piece is joined exactly once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal

from tokenline.v1 import common_pb2, detokenizer_pb2

from services.common.errors import AlreadyExistsError

ReqStage = Literal["created", "dispatched", "receiving", "finished", "removed"]
_ORDER: dict[ReqStage, int] = {
    "created": 0,
    "dispatched": 1,
    "receiving": 2,
    "finished": 3,
    "removed": 4,
}


@dataclass(slots=True, eq=False)
class ReqState:
    """One choice of one client request, from before dispatch until removal."""

    rid: str
    index: int
    sink: asyncio.Queue[int]
    label: str = ""  # the client's id for this choice, for logs
    times: common_pb2.StageTimes = field(default_factory=common_pb2.StageTimes)
    stage: ReqStage = "created"
    scheduler: str = ""
    dispatched: bool = False
    abort_sent: bool = False
    dispatch_call: asyncio.Future | None = None  # the AddRequest call while in flight
    error: str | None = None  # a service it needed was lost: UNAVAILABLE, retryable
    text_chunks: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    final: detokenizer_pb2.StrRow | None = None
    is_pending: bool = False  # has news the consumer has not taken

    @property
    def is_finished(self) -> bool:
        return _ORDER[self.stage] >= _ORDER["finished"]

    @property
    def needs_abort(self) -> bool:
        return self.dispatched and not self.is_finished_by_scheduler and not self.abort_sent

    @property
    def is_finished_by_scheduler(self) -> bool:
        return self.final is not None

    def advance(self, stage: ReqStage) -> None:
        if _ORDER[stage] > _ORDER[self.stage]:
            self.stage = stage

    def push(self, row: detokenizer_pb2.StrRow) -> None:
        """Gather one row from the detokenizer; rows after the final one are ignored."""
        if self.is_finished:
            return
        if not self.times.first_token:
            self.times.first_token = time.time()
        self.advance("receiving")
        if row.text:
            self.text_chunks.append(row.text)
        self.output_ids.extend(row.output_ids)
        self.logprobs.extend(row.logprobs)
        if row.HasField("finish_reason"):
            self.final = row
            self.times.finished = time.time()
            self.advance("finished")
        self._notify()

    def fail(self, message: str) -> None:
        """End the request from the frontend's side; the scheduler may still hold it."""
        if self.is_finished:
            return
        self.error = message
        self.advance("finished")
        self._notify()

    def take(self) -> detokenizer_pb2.StrRow:
        """Everything gathered since the last take, as one row."""
        row = detokenizer_pb2.StrRow(
            rid=self.rid,
            text="".join(self.text_chunks),
            output_ids=self.output_ids,
            logprobs=self.logprobs,
        )
        self.text_chunks, self.output_ids, self.logprobs = [], [], []
        self.is_pending = False
        if self.final is not None:
            row.finish_reason.CopyFrom(self.final.finish_reason)
            row.usage.CopyFrom(self.final.usage)
            row.times.CopyFrom(merged_times(self.times, self.final.times))
        return row

    def _notify(self) -> None:
        if not self.is_pending:
            self.is_pending = True
            self.sink.put_nowait(self.index)


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
        self, rids: list[str], sink: asyncio.Queue[int], times: common_pb2.StageTimes
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
        state.advance("removed")
