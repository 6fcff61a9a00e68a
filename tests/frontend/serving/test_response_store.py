"""The response store: bounded in entries and age, a miss names the id and the field."""

from __future__ import annotations

import pytest
from tokenline.v1 import openai_pb2, responses_pb2

from services.common.errors import NotFoundError
from services.frontend.serving.response_store import ResponseStore


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _put(store: ResponseStore, name: str) -> None:
    message = openai_pb2.ChatMessage(role="user", content=name)
    store.put(responses_pb2.Response(id=name), [message])


def test_the_oldest_goes_past_capacity() -> None:
    store = ResponseStore(capacity=2, ttl_s=10, clock=_Clock())
    for name in ("a", "b", "c"):
        _put(store, name)
    assert len(store) == 2 and store.num_evicted == 1
    assert store.get("c", "previous_response_id").conversation[0].content == "c"
    with pytest.raises(NotFoundError) as info:
        store.get("a", "previous_response_id")
    assert info.value.field == "previous_response_id" and "'a'" in info.value.message


def test_entries_expire_after_ttl() -> None:
    clock = _Clock()
    store = ResponseStore(capacity=8, ttl_s=10, clock=clock)
    _put(store, "a")
    clock.now = 5
    _put(store, "b")
    clock.now = 10
    with pytest.raises(NotFoundError):
        store.get("a", "response_id")
    assert store.get("b", "response_id").response.id == "b" and store.num_evicted == 1


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        ResponseStore(capacity=0)


def test_another_owners_response_reads_as_unknown() -> None:
    store = ResponseStore(capacity=2, ttl_s=10, clock=_Clock())
    store.put(responses_pb2.Response(id="r"), [], owner="alice")
    assert store.get("r", "response_id", lambda owner: owner == "alice").owner == "alice"
    with pytest.raises(NotFoundError) as info:
        store.get("r", "response_id", lambda owner: owner == "bob")
    assert "'r'" in info.value.message


def test_dropping_an_entry_stops_its_run_and_replacing_it_does_not() -> None:
    stopped: list[str] = []
    store = ResponseStore(capacity=2, ttl_s=10, clock=_Clock())

    def put(name: str, *, running: bool) -> None:
        stop = (lambda: stopped.append(name)) if running else None
        store.put(responses_pb2.Response(id=name), [], stop=stop)

    put("a", running=True)
    put("a", running=False)  # the run stored its finished response over the running one
    put("b", running=True)
    put("c", running=True)  # evicts "a": nothing runs for it any more
    assert stopped == []
    put("d", running=False)  # evicts "b"
    assert stopped == ["b"]
    store.delete("c")
    assert stopped == ["b", "c"] and len(store) == 1
    with pytest.raises(NotFoundError) as info:
        store.delete("c")
    assert info.value.field == "response_id"
