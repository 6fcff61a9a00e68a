"""ReqState: the frontend's record of one in-flight rid, and the table of them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tokenline.v1 import detokenizer_pb2

from services.common.errors import AlreadyExistsError


@dataclass(slots=True, eq=False)
class ReqState:
    """Created before dispatch; removed when the request ends in any way.

    ``sink`` is shared by every choice of one client request, so one consumer
    sees rows of all its rids in arrival order, tagged with ``index``.
    """

    rid: str
    index: int
    sink: asyncio.Queue[tuple[int, detokenizer_pb2.StrRow]]
    scheduler: str = ""
    dispatched: bool = False
    finished: bool = False
    abort_sent: bool = False
    text_chunks: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


class ReqStateTable:
    def __init__(self) -> None:
        self._states: dict[str, ReqState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def create(self, rid: str, index: int, sink: asyncio.Queue) -> ReqState:
        if rid in self._states:
            raise AlreadyExistsError(f"request id {rid!r} is already in flight", field="rid")
        state = ReqState(rid=rid, index=index, sink=sink)
        self._states[rid] = state
        return state

    def live(self) -> list[ReqState]:
        return list(self._states.values())

    def get(self, rid: str) -> ReqState | None:
        return self._states.get(rid)

    def remove(self, rid: str) -> None:
        self._states.pop(rid, None)
