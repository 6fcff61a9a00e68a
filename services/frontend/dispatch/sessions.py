"""SessionRoutes: which scheduler holds each session this frontend opened.

A session's state (its tree of requests, the KV it pins) lives in one scheduler
(services/scheduler/core/sessions.py); the frontend only routes. Every request of a session
goes to the replica that holds it, never to the least-loaded one, and a session is
reachable through the frontend that opened it: its lease on that replica bounds the
session's life. When that lease ends the replica closes the session, and this frontend
forgets it (``drop_scheduler``), so later requests naming it are refused here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.deadlines import ENGINE_ANSWER_RPC_TIMEOUT_S
from services.common.errors import AlreadyExistsError, InvalidArgumentError

logger = logging.getLogger(__name__)


class SessionRoutes:
    """Loop only. ``pick`` chooses the replica for a new session (the router's choice)."""

    def __init__(
        self,
        stubs: dict[str, scheduler_pb2_grpc.SchedulerServiceStub],
        pick: Callable[[], str],
        frontend_id: str,
    ) -> None:
        self._stubs = stubs
        self._pick = pick
        self._frontend_id = frontend_id
        self._addrs: dict[str, str] = {}  # session id -> scheduler address

    def __len__(self) -> int:
        return len(self._addrs)

    async def open(self, session_id: str, capacity: int) -> str:
        """Open a session on a replica; returns its id (the client's, or a new one)."""
        if capacity <= 0:
            raise InvalidArgumentError(
                f"must be a positive token count, got {capacity}", field="capacity_of_str_len"
            )
        session_id = session_id or uuid.uuid4().hex
        if session_id in self._addrs:
            raise AlreadyExistsError(f"session {session_id!r} is already open", field="session_id")
        addr = self._pick()
        self._addrs[session_id] = addr  # claimed now: a second open of the id is refused
        request = scheduler_pb2.OpenSessionReq(
            session_id=session_id, capacity_of_str_len=capacity, owner=self._frontend_id
        )
        try:
            await self._stubs[addr].OpenSession(request, timeout=ENGINE_ANSWER_RPC_TIMEOUT_S)
        except BaseException:
            self._addrs.pop(session_id, None)
            raise
        logger.info("session %s opened on %s", session_id, addr)
        return session_id

    async def close(self, session_id: str) -> None:
        """Close a session: its replica aborts its running requests and unpins its KV."""
        addr = self._addrs.pop(session_id, None)
        if addr is None:
            raise InvalidArgumentError(f"no open session {session_id!r}", field="session_id")
        request = scheduler_pb2.CloseSessionReq(session_id=session_id)
        await self._stubs[addr].CloseSession(request, timeout=ENGINE_ANSWER_RPC_TIMEOUT_S)

    def scheduler_of(self, session_id: str) -> str:
        """The replica holding the session; INVALID_ARGUMENT naming session_params.id when
        this frontend holds no such session (never opened here, closed, or its replica's
        lease ended)."""
        addr = self._addrs.get(session_id)
        if addr is None:
            raise InvalidArgumentError(
                f"no open session {session_id!r} on this frontend", field="session_params.id"
            )
        return addr

    def drop_scheduler(self, addr: str) -> None:
        """The lease on ``addr`` ended: it closed this frontend's sessions there."""
        lost = [s for s, a in self._addrs.items() if a == addr]
        for session_id in lost:
            del self._addrs[session_id]
        if lost:
            logger.warning("%d sessions on %s closed with its lease", len(lost), addr)
