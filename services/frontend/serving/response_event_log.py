"""The events a background response emitted, kept for ResponsesGetStream (OpenAI's
``GET /v1/responses/{id}?stream=true&starting_after=N``): one log per stored background
response, dropped with its entry.

Bounded per response in events and in bytes (the events' serialized size). Past either
bound the oldest events are forgotten (the newest, and so the terminal one, are always
kept): a replay that starts before the first kept event, or a follower that falls that
far behind, is refused naming ``starting_after`` rather than given a stream with a hole.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import TypeAlias

from tokenline.v1 import responses_pb2

from services.common.errors import InvalidArgumentError

DEFAULT_MAX_EVENTS = 8192
DEFAULT_MAX_BYTES = 1 << 20

Event: TypeAlias = responses_pb2.ResponseStreamEvent


class ResponseEventLog:
    """Append-only while the run lives (``append``), then ``close``d after its terminal
    event; ``follow`` replays and then waits for more until closed."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_events < 1 or max_bytes < 1:
            raise ValueError("an event log needs max_events >= 1 and max_bytes >= 1")
        self.max_events, self.max_bytes = max_events, max_bytes
        self._events: deque[tuple[Event, int]] = deque()  # (event, its size)
        self.num_bytes = 0
        self.first_seq = 0  # the sequence number of the oldest kept event
        self.is_closed = False
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._events)

    @property
    def next_seq(self) -> int:
        """The sequence number the next event will have (events are numbered 0, 1, ...)."""
        return self.first_seq + len(self._events)

    def append(self, event: Event) -> None:
        """Keep ``event`` (its sequence number must be ``next_seq``), forgetting the oldest
        past the bounds; a closed log takes nothing more."""
        if self.is_closed:
            return
        if event.sequence_number != self.next_seq:
            raise ValueError(f"event {event.sequence_number} after {self.next_seq - 1}")
        size = event.ByteSize()
        self._events.append((event, size))
        self.num_bytes += size
        while len(self._events) > 1 and (
            len(self._events) > self.max_events or self.num_bytes > self.max_bytes
        ):
            self.num_bytes -= self._events.popleft()[1]
            self.first_seq += 1
        self._wake()

    def close(self) -> None:
        """No more events: followers end after the last one."""
        self.is_closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def check_start(self, starting_after: int | None) -> int:
        """The first sequence number a replay after ``starting_after`` (None: from the
        start) sends; InvalidArgumentError naming ``starting_after`` when it is not an
        event of this response or its events were forgotten."""
        if starting_after is None:
            starting_after = -1
        elif starting_after < 0 or starting_after >= self.next_seq:
            raise InvalidArgumentError(
                f"starting_after: {starting_after} is not an event of this response "
                f"(its events so far are 0 to {self.next_seq - 1})",
                field="starting_after",
            )
        if starting_after + 1 < self.first_seq:
            raise self._forgotten(starting_after)
        return starting_after + 1

    def _forgotten(self, starting_after: int) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"starting_after: events up to {self.first_seq - 1} of this response are no "
            f"longer kept (at most {self.max_events} events and {self.max_bytes} bytes per "
            f"response); replay after {self.first_seq - 1} or later, not {starting_after}",
            field="starting_after",
        )

    async def follow(self, starting_after: int | None = None) -> AsyncIterator[Event]:
        """The events after ``starting_after`` that are kept now, then each new one as it
        comes, until the log is closed. Checked (``check_start``) before the first event."""
        seq = self.check_start(starting_after)
        while True:
            changed = self._changed
            while seq < self.next_seq:
                if seq < self.first_seq:  # forgotten while this follower was away
                    raise self._forgotten(seq - 1)
                yield self._events[seq - self.first_seq][0]
                seq += 1
            if self.is_closed:
                return
            if changed is self._changed:
                await changed.wait()
