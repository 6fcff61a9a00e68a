"""Sessions (SGLang's): a tree of requests whose tokens stay in KV between turns.

A session is opened by a frontend and lives no longer than that frontend's lease. Each
request sent in it becomes a node keyed by its rid (the cluster rid the frontend made,
which the client read back as the output's ``rid``). A request that names an earlier
one (``SessionParams.rid``) continues it: its input is the parent's prompt and output
(or the parent's prompt only, or a prefix of either, cut at ``offset``), then its own
new tokens. ``replace`` first drops the parent's other continuations, or without a
parent the whole tree; a dropped request still running is aborted.

KV: when a request of a session finishes, its last sampled token gets its K/V too (the
scheduler's next step computes it, a chunk that samples nothing, its logits never made),
and every token of the request is pinned in the radix cache with a lock of the session's
own. So the next turn finds its parent's whole sequence cached and prefills only its new
tokens. Closing the session (or dropping a node) gives the locks back: the KV becomes an
ordinary evictable prefix.

Engine thread only, like the rest of the scheduler core; the scheduler is its only
caller. No protobuf here: ``transport.proto_codec`` converts ``SessionParams`` at the edge.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.common.errors import AlreadyExistsError, InvalidArgumentError
from services.scheduler.core.req import Req, ReqStatus, SessionParams
from services.scheduler.mem_cache.kv_cache import KVCacheManager
from services.scheduler.mem_cache.radix_cache import TreeNode

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class SessionNode:
    req: Req
    parent: SessionNode | None = None
    children: list[SessionNode] = field(default_factory=list)
    pin: TreeNode | None = None  # radix node of the request's tokens, locked by the session

    @property
    def is_live(self) -> bool:
        return not self.req.is_finished

    @property
    def is_complete(self) -> bool:
        """Finished by a stop or a length limit: a valid parent. An aborted request is not
        (its output is cut wherever the abort landed)."""
        finish = self.req.finish
        is_finished = self.req.status is ReqStatus.FINISHED
        return is_finished and finish is not None and finish.kind != "abort"

    def subtree(self) -> list[SessionNode]:
        out, stack = [], [self]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children)
        return out


@dataclass(slots=True, eq=False)
class Session:
    id: str
    capacity: int  # the most tokens a request's assembled input may hold
    owner: str  # the frontend whose lease bounds the session's life
    nodes: dict[str, SessionNode] = field(default_factory=dict)  # by rid


@dataclass(frozen=True, slots=True)
class Joining:
    """A checked plan for a request to join its session: ``SessionManager.join`` commits
    it. Nothing is changed before then, so a request refused later leaves no trace."""

    session: Session
    parent: SessionNode | None
    dropped: list[SessionNode]  # subtrees ``replace`` clears


class SessionManager:
    """Every session open on this scheduler, the tree of each and the KV it pins."""

    def __init__(self, kv: KVCacheManager, bos_token_id: int | None) -> None:
        self.kv = kv
        self.bos_token_id = bos_token_id  # a continuation's own leading BOS is dropped
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    # ---- open and close ------------------------------------------------------------

    def open(self, session_id: str, capacity: int, owner: str) -> None:
        """Open an empty session; ALREADY_EXISTS while one with that id is open."""
        if not session_id:
            raise InvalidArgumentError("must be non-empty", field="session_id")
        if capacity <= 0:
            raise InvalidArgumentError(
                f"must be a positive token count, got {capacity}", field="capacity_of_str_len"
            )
        if session_id in self._sessions:
            raise AlreadyExistsError(f"session {session_id!r} is already open", field="session_id")
        self._sessions[session_id] = Session(session_id, capacity, owner)
        logger.info("session %s opened by %s (capacity %d)", session_id, owner, capacity)

    def close(self, session_id: str) -> list[Req]:
        """Close a session and unpin its KV; returns its requests still running, for the
        caller to abort. INVALID_ARGUMENT for an unknown (or already closed) id."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise InvalidArgumentError(
                f"no open session {session_id!r} on this scheduler", field="session_id"
            )
        live = self._drop(session, list(session.nodes.values()))
        logger.info("session %s closed (%d requests aborted)", session_id, len(live))
        return live

    def close_owned(self, owner: str) -> list[Req]:
        """Close every session ``owner`` opened (its lease ended); their running requests
        are returned for the caller to abort."""
        owned = [s.id for s in self._sessions.values() if s.owner == owner]
        return [req for session_id in owned for req in self.close(session_id)]

    # ---- requests ------------------------------------------------------------------

    def prepare(self, req: Req, params: SessionParams) -> Joining:
        """Check ``req`` (in the session ``params`` names) and put the parent's ids in front
        of its own (``req.input_ids`` is rewritten; the session is not: see ``join``)."""
        session = self._sessions.get(params.id)
        if session is None:
            raise InvalidArgumentError(f"no open session {params.id!r}", field="session_params.id")
        if req.rid in session.nodes:
            raise AlreadyExistsError(
                f"session {params.id!r} already has a request {req.rid!r}", field="rid"
            )
        parent = self._parent(session, params) if params.rid else None
        dropped: list[SessionNode] = []
        if params.replace:
            dropped = list(parent.children) if parent else _roots(session)
        if parent is not None:
            req.input_ids = self._continued_ids(parent.req, params, req.input_ids)
        if len(req.input_ids) > session.capacity:
            raise InvalidArgumentError(
                f"the request would hold {len(req.input_ids)} tokens; session {params.id!r} "
                f"holds at most {session.capacity} (capacity_of_str_len)",
                field="session_params.id",
            )
        return Joining(session, parent, dropped)

    def join(self, req: Req, joining: Joining) -> list[Req]:
        """Commit ``prepare``'s plan: the replaced subtrees leave the session and ``req``
        becomes a node. Returns the dropped requests still running, for the caller to
        abort."""
        nodes = [n for root in joining.dropped for n in root.subtree()]
        live = self._drop(joining.session, nodes)
        node = SessionNode(req, joining.parent)
        if joining.parent is not None:
            joining.parent.children.append(node)
        joining.session.nodes[req.rid] = node
        return live

    def on_finish(self, req: Req) -> bool:
        """``req`` is leaving the scheduler (before its KV is released): a complete one keeps
        its whole sequence in KV, pinned until the session drops it. True when its last
        sampled token has no K/V yet: the caller keeps the KV, has that token computed,
        then calls ``pin``. Otherwise whatever is to be pinned is pinned now."""
        node = self._node_of(req)
        if node is None or not node.is_complete or self.kv.tree is None:
            return False
        if req.num_uncomputed == 1:
            return True
        node.pin = self.kv.pin(req)
        return False

    def pin(self, req: Req) -> None:
        """Pin the tokens of a complete request ``on_finish`` deferred (its last token is
        computed now, or found no slot: the next turn recomputes it); nothing if the
        session dropped it meanwhile."""
        node = self._node_of(req)
        if node is not None and node.is_complete:
            node.pin = self.kv.pin(req)

    # ---- internals -----------------------------------------------------------------

    def _parent(self, session: Session, params: SessionParams) -> SessionNode:
        node = session.nodes.get(params.rid)
        if node is None:
            raise InvalidArgumentError(
                f"session {params.id!r} has no request {params.rid!r}", field="session_params.rid"
            )
        if node.is_live:
            raise InvalidArgumentError(
                f"request {params.rid!r} has not finished; continue it once it has",
                field="session_params.rid",
            )
        if not node.is_complete:
            raise InvalidArgumentError(
                f"request {params.rid!r} was aborted; it cannot be continued",
                field="session_params.rid",
            )
        return node

    def _continued_ids(self, parent: Req, params: SessionParams, own: list[int]) -> list[int]:
        """The parent's prompt (and output unless dropped), cut at ``offset``, then the
        request's own ids without a leading BOS (it is not the start of the text)."""
        if own and own[0] == self.bos_token_id:
            own = own[1:]
        ids = list(parent.input_ids)
        if not params.drop_previous_output:
            ids += parent.output_ids[: parent.params.max_new_tokens]
        if params.offset < 0 or params.offset > len(ids):
            raise InvalidArgumentError(
                f"must be in [0, {len(ids)}] (the parent's ids), got {params.offset}",
                field="session_params.offset",
            )
        if params.offset:
            ids = ids[: params.offset]
        return ids + own

    def _drop(self, session: Session, nodes: list[SessionNode]) -> list[Req]:
        """Remove ``nodes`` from the session and unpin their KV; returns the live ones."""
        for node in nodes:
            session.nodes.pop(node.req.rid, None)
            if node.parent is not None and node in node.parent.children:
                node.parent.children.remove(node)
            if node.pin is not None:
                self.kv.unpin(node.pin)
                node.pin = None
        return [n.req for n in nodes if n.is_live]

    def _node_of(self, req: Req) -> SessionNode | None:
        """The node of ``req`` while its session holds it."""
        params = req.session
        session = self._sessions.get(params.id) if params is not None else None
        node = session.nodes.get(req.rid) if session is not None else None
        return node if node is not None and node.req is req else None


def _roots(session: Session) -> list[SessionNode]:
    return [n for n in session.nodes.values() if n.parent is None]
