"""SchedulerRouter: this frontend's leases on the scheduler replicas, and which one
gets the next request.

Scheduler replicas are data-parallel engines. The router holds one ``Attach``
stream (the lease) per replica: a replica runs this frontend's requests only while
the lease is up, and aborts them all when it ends, so a frontend that dies leaves
nothing running. The frontend renews the lease every 250 ms (a frozen or partitioned frontend stops
renewing, which its open TCP connection would hide) and the scheduler beats back with its
load at the same pace.

Routing picks the least-loaded leased replica. A beat's load counts the requests
the replica has accepted; what this frontend sent that the beat has not counted yet
(``num_accepted`` tells exactly how many it has) is added on top, so a burst spreads
out between beats and nothing is counted twice. A replica whose lease ends or whose
beats stop is skipped until a new lease is up, and ``on_down`` lets the owner fail
the requests it holds there right away: the replica aborts them on its side.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

DOWN_BACKOFF_S = 2.0
# A lease whose beats (every 250 ms) stop for this long is treated as lost.
BEAT_TIMEOUT_S = 2.0
# How often this frontend renews each lease (a scheduler ends one unrenewed for 2 s).
RENEW_INTERVAL_S = 0.25
# Between attempts to open a lease: a scheduler refuses one until its model is loaded, and
# is then serving within this long of being ready (a refused Attach costs it nothing).
ATTACH_RETRY_MAX_S = 0.25


class SchedulerRouter:
    def __init__(
        self,
        stubs: dict[str, scheduler_pb2_grpc.SchedulerServiceStub],
        frontend_id: str,
        on_down: Callable[[str], None] = lambda addr: None,
        beat_timeout: float = BEAT_TIMEOUT_S,
    ) -> None:
        self._stubs = stubs
        self._frontend_id = frontend_id
        self._on_down = on_down
        self._beat_timeout = beat_timeout
        self._leased = dict.fromkeys(stubs, False)
        self._beat_load = dict.fromkeys(stubs, 0)  # waiting + running, from the last beat
        self._num_dispatched = dict.fromkeys(stubs, 0)  # by this frontend, ever
        self._num_dispatched_at_lease = dict.fromkeys(stubs, 0)  # when the lease came up
        self._num_accepted = dict.fromkeys(stubs, 0)  # on this lease, from the last beat
        self._down_until = dict.fromkeys(stubs, 0.0)
        self._dtypes: dict[str, str] = {}  # per replica, from its last beat
        self._model_paths: dict[str, tuple[str, str]] = {}  # (architecture, model_impl)
        self._context_lengths: dict[str, int] = {}  # per replica, as it enforces it
        self._runners: dict[str, str] = {}  # per replica: generate | pooling (--runner)
        self._hidden_sizes: dict[str, int] = {}  # per replica: a pooled vector's length
        self._turn = 0
        self._tasks: list[asyncio.Task] = []
        self._calls: dict[str, grpc.aio.StreamStreamCall] = {}  # the open lease per replica

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._hold_lease(addr), name=f"lease-{addr}")
            for addr in self._stubs
        ]

    async def close(self) -> None:
        # The calls first: a task cancelled while it waits on a beat waits in turn for
        # grpc's read to give up, and that read ends only when its call does.
        for call in self._calls.values():
            call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def load(self, addr: str) -> int:
        """The replica's load at its last beat plus what this frontend sent it that the
        beat had not counted."""
        sent = self._num_dispatched[addr] - self._num_dispatched_at_lease[addr]
        return self._beat_load[addr] + max(0, sent - self._num_accepted[addr])

    def is_leased(self, addr: str) -> bool:
        return self._leased[addr]

    def is_up(self, addr: str) -> bool:
        return self._leased[addr] and time.monotonic() >= self._down_until[addr]

    def any_answering(self) -> bool:
        """Whether some replica holds a live lease for this frontend: readiness needs one
        that can run a request now."""
        return any(self._leased.values())

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

    def mark_down(self, addr: str) -> None:
        """Route around ``addr`` for a while: it refused with UNAVAILABLE (draining, or
        about to lose the lease). Its requests go on; a lost lease fails them."""
        self._down_until[addr] = time.monotonic() + DOWN_BACKOFF_S

    def context_length(self) -> int:
        """The context length every leased replica can serve (the least of theirs; 0
        while none is leased): the one source of the model's limits."""
        leased = [n for a, n in self._context_lengths.items() if self._leased[a] and n]
        return min(leased, default=0)

    def runs_pooling_only(self) -> bool:
        """Whether a leased replica runs a pooling model (``--runner pooling``): it serves
        no generation, so none is dispatched while one holds a lease."""
        return any(self._leased[a] and r == "pooling" for a, r in self._runners.items())

    def hidden_size(self) -> int:
        """The length of a pooled vector, as the leased replicas report it (0 while none
        has beaten yet)."""
        return max((n for a, n in self._hidden_sizes.items() if self._leased[a]), default=0)

    def served_dtype(self) -> str:
        """The dtype the replicas reported, comma-joined when they differ ("" while no
        lease has beaten yet)."""
        return ",".join(sorted(set(self._dtypes.values())))

    def served_architecture(self) -> str:
        """The checkpoint class the replicas reported, as ``served_dtype`` joins them."""
        return ",".join(sorted({arch for arch, _ in self._model_paths.values()}))

    def served_model_impl(self) -> str:
        """The path serving it (native, transformers), as ``served_dtype`` joins them."""
        return ",".join(sorted({impl for _, impl in self._model_paths.values()}))

    async def _hold_lease(self, addr: str) -> None:
        """Keep a lease on ``addr`` for as long as the router runs."""
        backoff = 0.05
        while True:
            # wait_for_ready: a scheduler not listening yet is waited for, not polled.
            call = self._stubs[addr].Attach(self._renewals(), wait_for_ready=True)
            self._calls[addr] = call
            why = "lease ended"
            try:
                beats = call.__aiter__()
                while True:
                    beat = await asyncio.wait_for(anext(beats), self._beat_timeout)
                    self._on_beat(addr, beat)
                    backoff = 0.05
            except StopAsyncIteration:
                pass
            except TimeoutError:
                why = f"no beat for {self._beat_timeout:.1f}s"
            except grpc.aio.AioRpcError as exc:
                why = exc.code().name
            finally:
                call.cancel()
            self._lease_lost(addr, why)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, ATTACH_RETRY_MAX_S)

    async def _renewals(self) -> AsyncIterator[scheduler_pb2.AttachRequest]:
        """Open the lease, then renew it: the scheduler ends a lease it stops hearing."""
        request = scheduler_pb2.AttachRequest(frontend_id=self._frontend_id)
        while True:
            yield request
            await asyncio.sleep(RENEW_INTERVAL_S)

    def _on_beat(self, addr: str, beat: scheduler_pb2.SchedulerBeat) -> None:
        if not self._leased[addr]:
            self._leased[addr] = True
            self._num_dispatched_at_lease[addr] = self._num_dispatched[addr]
            self._down_until[addr] = 0.0
            logger.info("lease on scheduler %s is up", addr)
        self._beat_load[addr] = beat.info.num_waiting + beat.info.num_running
        self._num_accepted[addr] = beat.num_accepted
        if beat.info.dtype:
            self._dtypes[addr] = beat.info.dtype
        if beat.info.model_impl:
            self._model_paths[addr] = (beat.info.architecture, beat.info.model_impl)
        self._context_lengths[addr] = beat.info.context_length
        self._runners[addr] = beat.info.runner or "generate"
        self._hidden_sizes[addr] = beat.info.hidden_size

    def _lease_lost(self, addr: str, why: str) -> None:
        if not self._leased[addr]:
            return
        self._leased[addr] = False
        self._beat_load[addr] = 0
        self._num_accepted[addr] = 0
        logger.warning("lease on scheduler %s lost (%s); routing around it", addr, why)
        self._on_down(addr)
