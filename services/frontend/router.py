"""SchedulerRouter: which scheduler replica gets the next request.

Scheduler replicas are data-parallel engines. The router polls each one's
GetInfo (waiting + running) and adds the requests this frontend dispatched since
that poll was sent, so a burst spreads out before the next poll; requests the
poll already counted are not counted again. The same polls tell which
dtype the replicas run the model in, for the model card. A replica that fails a
poll or refuses with UNAVAILABLE is skipped until it answers again, and the
``on_down`` callback lets the owner fail the requests it holds right away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

DOWN_BACKOFF_S = 2.0


class SchedulerRouter:
    def __init__(
        self,
        stubs: dict[str, scheduler_pb2_grpc.SchedulerServiceStub],
        on_down: Callable[[str], None] = lambda addr: None,
        poll_interval: float = 0.25,
    ) -> None:
        self._stubs = stubs
        self._on_down = on_down
        self._poll_interval = poll_interval
        self._polled_load = dict.fromkeys(stubs, 0)
        self._num_dispatched = dict.fromkeys(stubs, 0)  # ever, by this frontend
        self._num_dispatched_at_poll = dict.fromkeys(stubs, 0)  # when the last answer was asked
        self._down_until = dict.fromkeys(stubs, 0.0)
        self._answered = dict.fromkeys(stubs, False)  # did its last poll get an answer
        self._dtypes: dict[str, str] = {}  # per replica, from its last answer
        self._turn = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll_forever(), name="scheduler-router")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def load(self, addr: str) -> int:
        """The replica's last polled load plus what this frontend sent it since."""
        unseen = self._num_dispatched[addr] - self._num_dispatched_at_poll[addr]
        return self._polled_load[addr] + max(0, unseen)

    def is_up(self, addr: str) -> bool:
        return time.monotonic() >= self._down_until[addr]

    def any_answering(self) -> bool:
        """Whether some replica answered its latest poll: readiness needs one that can run
        a request, not one that merely has not been tried for a while."""
        return any(self._answered.values())

    def pick(self, exclude: str = "") -> str:
        """The least-loaded replica that is up (any replica if none is); ties rotate."""
        addrs = [a for a in self._stubs if a != exclude] or list(self._stubs)
        live = [a for a in addrs if self.is_up(a)] or addrs
        self._turn += 1
        rotated = live[self._turn % len(live) :] + live[: self._turn % len(live)]
        return min(rotated, key=self.load)

    def dispatched(self, addr: str) -> None:
        self._num_dispatched[addr] += 1

    def refused(self, addr: str) -> None:
        """A dispatch the replica turned away: it never held the request."""
        self._num_dispatched[addr] -= 1

    def mark_down(self, addr: str, *, lost: bool = True) -> None:
        """Route around ``addr`` for a while; ``lost`` (it stopped answering at all)
        also fails the requests it holds. A draining replica refuses new work but
        finishes its own, so a refusal passes ``lost=False``."""
        was_up = self.is_up(addr)
        self._down_until[addr] = time.monotonic() + DOWN_BACKOFF_S
        if was_up and lost:
            logger.warning("scheduler %s unavailable; routing around it", addr)
            self._on_down(addr)

    async def served_dtype(self) -> str:
        """The dtype the replicas reported, comma-joined when they differ ("" while none
        answers). Before the first answer it polls them now rather than wait for the loop."""
        if not self._dtypes:
            await self.refresh()
        return ",".join(sorted(set(self._dtypes.values())))

    async def refresh(self) -> None:
        """Poll every replica once now (the loop does so every ``poll_interval``)."""
        await asyncio.gather(*(self._poll(addr) for addr in self._stubs))

    async def _poll_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._poll_interval)

    async def _poll(self, addr: str) -> None:
        # Sent before the request: what this frontend dispatched after it may be missing
        # from the answer, so it stays counted on top.
        dispatched_before = self._num_dispatched[addr]
        try:
            info = await self._stubs[addr].GetInfo(scheduler_pb2.ServerInfoRequest(), timeout=2)
        except grpc.aio.AioRpcError as exc:
            is_gone = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            self._answered[addr] = not is_gone  # any other status is still an answer
            if is_gone:
                self.mark_down(addr)  # gone, or too wedged to answer: route around it
            return
        self._answered[addr] = True
        self._polled_load[addr] = info.num_waiting + info.num_running
        self._num_dispatched_at_poll[addr] = dispatched_before
        if info.dtype:
            self._dtypes[addr] = info.dtype
        self._down_until[addr] = 0.0
