"""A background response's event log: replay after a sequence number, live following until
closed, bounded in events and bytes (a replay from before the oldest kept event is refused
naming ``starting_after``), and gone with its store entry."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
from tokenline.v1 import openai_pb2, responses_pb2

from services.common.errors import InvalidArgumentError
from services.frontend.serving.response_event_log import ResponseEventLog
from services.frontend.serving.response_store import ResponseStore

Event = responses_pb2.ResponseStreamEvent


def _log(num_events: int, **bounds: int) -> ResponseEventLog:
    log = ResponseEventLog(**bounds)
    for seq in range(num_events):
        log.append(Event(type="response.output_text.delta", sequence_number=seq, delta="ab"))
    return log


async def _seqs(log: ResponseEventLog, starting_after: int | None = None) -> list[int]:
    return [event.sequence_number async for event in log.follow(starting_after)]


async def test_a_closed_log_replays_after_starting_after() -> None:
    log = _log(5)
    log.close()
    assert await _seqs(log) == [0, 1, 2, 3, 4]
    assert await _seqs(log, 2) == [3, 4]
    assert await _seqs(log, 4) == []  # after the last: nothing, and the stream ends


@pytest.mark.parametrize("starting_after", [-1, 5, 99])
async def test_a_starting_after_that_is_no_event_is_refused_by_name(starting_after: int) -> None:
    log = _log(5)
    with pytest.raises(InvalidArgumentError) as info:
        await _seqs(log, starting_after)
    assert info.value.field == "starting_after" and str(starting_after) in info.value.message


async def test_a_follower_gets_new_events_until_the_log_closes() -> None:
    log = _log(2)
    got: list[int] = []
    seen_two = asyncio.Event()

    async def follow() -> None:
        async for event in log.follow(0):
            got.append(event.sequence_number)
            if len(got) == 1:
                seen_two.set()

    task = asyncio.ensure_future(follow())
    await seen_two.wait()  # it has replayed event 1 and now waits for more
    log.append(Event(type="response.output_text.delta", sequence_number=2))
    log.append(Event(type="response.completed", sequence_number=3))
    log.close()
    await asyncio.wait_for(task, 10)
    assert got == [1, 2, 3]


def test_events_past_the_count_bound_forget_the_oldest() -> None:
    log = _log(10, max_events=4)
    assert len(log) == 4 and log.first_seq == 6 and log.next_seq == 10
    assert log.check_start(5) == 6  # the oldest kept is still replayable
    with pytest.raises(InvalidArgumentError) as info:
        log.check_start(4)
    assert info.value.field == "starting_after" and "no longer kept" in info.value.message
    with pytest.raises(InvalidArgumentError):
        log.check_start(None)  # from the start: event 0 is gone


def test_events_past_the_byte_bound_forget_the_oldest_but_keep_the_newest() -> None:
    size = Event(type="response.output_text.delta", sequence_number=1, delta="ab").ByteSize()
    log = _log(10, max_bytes=3 * size)
    assert len(log) == 3 and log.num_bytes <= 3 * size
    big = Event(type="response.completed", sequence_number=10, delta="x" * 10 * size)
    log.append(big)  # larger than the bound alone: kept, it is the terminal event
    assert len(log) == 1 and log.first_seq == 10


async def test_a_follower_left_behind_by_the_bound_is_refused() -> None:
    log = _log(2, max_events=2)
    follower = log.follow()
    assert (await anext(follower)).sequence_number == 0
    for seq in range(2, 6):  # events 1..3 are forgotten while it holds event 0
        log.append(Event(type="response.output_text.delta", sequence_number=seq))
    with pytest.raises(InvalidArgumentError) as info:
        await anext(follower)
    assert info.value.field == "starting_after"


def test_an_out_of_order_event_is_a_bug() -> None:
    log = _log(2)
    with pytest.raises(ValueError, match="event 5 after 1"):
        log.append(Event(type="x", sequence_number=5))


def test_the_log_is_dropped_with_its_store_entry() -> None:
    store = ResponseStore(capacity=1, ttl_s=10)
    log = _log(3)
    store.put(responses_pb2.Response(id="a"), [openai_pb2.ChatMessage()], events=log)
    assert store.get("a", "response_id").events is log
    kept = weakref.ref(log)
    del log
    store.put(responses_pb2.Response(id="b"), [openai_pb2.ChatMessage()])  # "a" goes
    gc.collect()
    assert kept() is None and store.get("b", "response_id").events is None
