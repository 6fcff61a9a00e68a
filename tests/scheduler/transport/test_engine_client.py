"""EngineClient's bookkeeping of outputs, over a fake transport that only records the
commands (the real transports are tested in test_engine_thread.py and
test_engine_process.py): a draining scheduler must never see it idle while the engine
still has work or rows on their way."""

from __future__ import annotations

from services.scheduler.core.messages import EngineLimits, EngineOutput, EngineStats
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import FinishInfo
from services.scheduler.transport.engine_client import EngineClient
from tests.scheduler.factories import make_req

LIMITS = EngineLimits(vocab_size=1000, context_length=64, num_kv_tokens=256, max_waiting_requests=4)


class FakeTransportClient(EngineClient):
    """Leaves commands in its inbox instead of taking them to an engine."""

    def __init__(self, sink) -> None:  # type: ignore[no-untyped-def]
        super().__init__(LIMITS, sink)


def _row(rid: str, finish: FinishInfo | None) -> OutputRow:
    return OutputRow(rid, (5,), finish, 3, 1, 0)


def test_never_idle_between_an_applied_command_and_its_rows() -> None:
    seen_idle: list[bool] = []
    client = FakeTransportClient(lambda rows: seen_idle.append(client.is_idle))
    assert client.is_idle
    client.add_request(make_req("a", [1, 2, 3], max_new_tokens=1))
    assert not client.is_idle and client.inbox.qsize() == 1  # queued, not applied

    # The engine applied it and ran a step in one output; its rows are being handed over.
    client.handle(
        EngineOutput(EngineStats(num_running=1), idle=False, num_applied=1, rows=(_row("a", None),))
    )
    assert seen_idle == [False] and not client.is_idle
    client.handle(EngineOutput(EngineStats(), idle=True, rows=(_row("a", FinishInfo("length")),)))
    assert seen_idle == [False, False]  # idle only once the final row was handed over
    assert client.is_idle and len(client.live) == 0  # and the rid is free again
