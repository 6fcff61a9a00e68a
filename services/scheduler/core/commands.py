"""Every command the engine takes, each declared once: its fields and what it does.

A command is plain data that travels unchanged, on a queue to an engine thread or
as Protobuf through the engine process's pipe (``transport/engine_codec.py``, generic: no
per-command code), and ``apply`` runs on the engine between steps, in the order the
commands were sent. The RPC side sends one with ``EngineClient.ask`` (the caller's
future gets what ``apply`` returns, or the ``TokenlineError`` it raises) or
``EngineClient.tell`` (nobody waits; ``refused`` handles a refusal). A new command is a
class here and the RPC that sends it; nothing else changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from services.common.errors import TokenlineError
from services.scheduler.core.messages import FlushOutcome
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import Scheduler

logger = logging.getLogger(__name__)

T = TypeVar("T")

NO_TICKET = 0  # a told command: nobody waits on its answer


class EngineCommand(Generic[T]):
    """A command whose answer (what ``apply`` returns) is a ``T``: plain data, since it
    may cross the pipe back. Subclasses are frozen, slotted dataclasses."""

    __slots__ = ()

    def apply(self, scheduler: Scheduler) -> T:
        """Engine thread, between steps: do it, or raise ``TokenlineError`` to refuse."""
        raise NotImplementedError

    def refused(self, scheduler: Scheduler, error: TokenlineError) -> None:
        """``apply`` refused a command nobody waits on; the default only logs it."""
        logger.warning("engine refused %s: %s", type(self).__name__, error)


# What the engine's inbox carries: a command with the ticket its answer goes back under
# (``NO_TICKET`` when told), or ``None``, which stops the engine.
Ticketed = tuple[int, EngineCommand[Any]]


@dataclass(frozen=True, slots=True)
class AddCommand(EngineCommand[None]):
    """Queue a request the RPC side accepted (``EngineLimits.validate`` ran there). A
    request in a session is asked: only the engine reads the session, so its verdict is
    the answer; any other is told."""

    req: Req

    def apply(self, scheduler: Scheduler) -> None:
        scheduler.add_request(self.req, validated=True)

    def refused(self, scheduler: Scheduler, error: TokenlineError) -> None:
        """The client was told "accepted": its only row, a final abort, says why not."""
        req = self.req
        logger.warning("engine refused rid=%s (label %s): %s", req.rid, req.label, error)
        scheduler.refuse(req, str(error))


@dataclass(frozen=True, slots=True)
class AbortCommand(EngineCommand[None]):
    rid: str
    reason: str

    def apply(self, scheduler: Scheduler) -> None:
        scheduler.abort(self.rid, self.reason)


@dataclass(frozen=True, slots=True)
class AbortStartedCommand(EngineCommand[None]):
    """Abort every live request whose first row already went downstream (the stream to
    the detokenizer broke, and with it their decode state)."""

    reason: str

    def apply(self, scheduler: Scheduler) -> None:
        for req in list(scheduler.reqs.values()):
            if req.sent_init:
                scheduler.abort(req.rid, self.reason)


@dataclass(frozen=True, slots=True)
class AbortOwnedCommand(EngineCommand[None]):
    """``owner``'s lease ended (a frontend id): its requests are aborted, its sessions
    closed."""

    owner: str
    reason: str

    def apply(self, scheduler: Scheduler) -> None:
        owned = [r for r in scheduler.reqs.values() if r.flags.reply_to == self.owner]
        for req in owned:
            scheduler.abort(req.rid, self.reason)
        if owned:
            logger.warning("aborted %d requests: %s", len(owned), self.reason)
        num_closed = scheduler.close_sessions_of(self.owner, self.reason)
        if num_closed:
            logger.warning("closed %d sessions: %s", num_closed, self.reason)


@dataclass(frozen=True, slots=True)
class FlushCommand(EngineCommand[FlushOutcome]):
    """Empty the prefix cache unless a request is running or waiting (SGLang refuses
    then too). Applied after every command sent before it, so a request accepted
    earlier counts."""

    def apply(self, scheduler: Scheduler) -> FlushOutcome:
        num_running, num_waiting = len(scheduler.running), len(scheduler.waiting)
        if num_running or num_waiting:
            reason = f"{num_running} running, {num_waiting} waiting"
            return FlushOutcome(False, num_running, num_waiting, reason)
        if not scheduler.flush_cache():
            return FlushOutcome(False, 0, 0, "cached prefixes are pinned (open sessions)")
        logger.info("prefix cache flushed")
        return FlushOutcome(True, 0, 0)


@dataclass(frozen=True, slots=True)
class OpenSessionCommand(EngineCommand[None]):
    session_id: str
    capacity: int
    owner: str

    def apply(self, scheduler: Scheduler) -> None:
        scheduler.open_session(self.session_id, self.capacity, self.owner)


@dataclass(frozen=True, slots=True)
class CloseSessionCommand(EngineCommand[None]):
    """Aborts the session's running requests and unpins its KV."""

    session_id: str

    def apply(self, scheduler: Scheduler) -> None:
        scheduler.close_session(self.session_id)
