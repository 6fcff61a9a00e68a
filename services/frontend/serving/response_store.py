"""Stored responses for ``previous_response_id`` and ResponsesGet: one owner, bounded in
entries and in age, so a client that never comes back costs at most ``capacity`` entries
for ``ttl_s`` seconds. Per frontend: another frontend's responses are unknown here.

An entry of a background response still running holds how to ``stop`` that run: dropping
the entry (for room, for age, or by ResponsesDelete) stops it, so no run outlives the
entry a client could poll or cancel it through. A background response's entry also holds
its event log (``response_event_log.py``) for ResponsesGetStream, forgotten with it."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokenline.v1 import openai_pb2, responses_pb2

from services.common.errors import NotFoundError
from services.frontend.serving.response_event_log import ResponseEventLog

DEFAULT_CAPACITY = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: responses_pb2.Response
    # The conversation a continuation starts from: the response's input (without its
    # instructions) and its output, as chat messages.
    conversation: tuple[openai_pb2.ChatMessage, ...]
    expires_at: float
    owner: str = ""  # the API key name it was made with ("" without keys)
    # The response's input items (ResponsesInputItems): the continued conversation's
    # items and its own input, in turn order.
    items: tuple[responses_pb2.ResponseOutputItem, ...] = ()
    # Ends the background run still making this response (None: nothing runs).
    stop: Callable[[], object] | None = None
    # The events a background response emitted (None: not made in the background).
    events: ResponseEventLog | None = None

    @property
    def is_running(self) -> bool:
        return self.stop is not None


class ResponseStore:
    """Oldest first; ``put`` evicts the oldest past ``capacity``, ``get`` drops expired ones."""

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or ttl_s <= 0:
            raise ValueError("a response store needs capacity >= 1 and ttl_s > 0")
        self.capacity, self.ttl_s, self._clock = capacity, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_evicted = 0  # dropped for room or age since start

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        response: responses_pb2.Response,
        conversation: list[openai_pb2.ChatMessage],
        owner: str = "",
        *,
        items: list[responses_pb2.ResponseOutputItem] | None = None,
        stop: Callable[[], object] | None = None,
        events: ResponseEventLog | None = None,
    ) -> None:
        """Keep ``response`` (replacing an entry of its id, whose run is not stopped: a
        background run puts its finished response over its running one)."""
        self._expire()
        expires_at = self._clock() + self.ttl_s
        entry = StoredResponse(
            response, tuple(conversation), expires_at, owner, tuple(items or ()), stop, events
        )
        self._entries[response.id] = entry
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            _drop(self._entries.popitem(last=False)[1])
            self.num_evicted += 1

    def get(
        self, response_id: str, field: str, may_read: Callable[[str], bool] = lambda _: True
    ) -> StoredResponse:
        """The stored response, or NotFoundError naming the id (``field`` says which
        request field asked). One ``may_read`` refuses by its owner is answered the same
        way, so another key's ids are not even confirmed."""
        self._expire()
        found = self._entries.get(response_id)
        if found is None or not may_read(found.owner):
            raise NotFoundError(
                f"Response with id '{response_id}' not found (never stored, or expired)",
                field=field,
            )
        return found

    def delete(
        self, response_id: str, may_read: Callable[[str], bool] = lambda _: True
    ) -> StoredResponse:
        """Forget a response (stopping its run); NotFoundError as ``get``."""
        found = self.get(response_id, "response_id", may_read)
        del self._entries[response_id]
        _drop(found)
        return found

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires_at > now:
                return
            _drop(self._entries.popitem(last=False)[1])
            self.num_evicted += 1


def _drop(entry: StoredResponse) -> None:
    if entry.stop is not None:
        entry.stop()
