"""Session routing in the frontend (services/frontend/dispatch/sessions.py, the TokenizerManager's
dispatch) against two fake scheduler replicas: real grpc.aio servers on loopback that
record what the frontend sends. The scheduler's side of sessions is tested against the
real engine in tests/scheduler/core/test_sessions.py, and end to end in
tests/integration/test_sessions.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from tokenline.v1 import detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, session_pb2

from services.common.errors import AlreadyExistsError, InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.frontend.dispatch.tokenizer_manager import TokenizedRequest, TokenizerManager
from tests.frontend.dispatch.test_tokenizer_manager import FakeDetokenizer, FakeScheduler
from tests.waiting import eventually


class FakeSessionScheduler(FakeScheduler):
    """FakeScheduler that also records the sessions opened on it and each request's
    session_params, and finishes every request at once through the fake detokenizer."""

    def __init__(self, detokenizer: FakeDetokenizer) -> None:
        super().__init__()
        self.sessions: dict[str, str] = {}  # session id -> owner
        self.session_of: dict[str, str] = {}  # rid -> the session id it named
        self.on_add = self._finish
        self._detokenizer = detokenizer

    async def _finish(self, request: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        self.session_of[request.rid] = request.session_params.id
        self._detokenizer.send(request.rid, "ok", final=True)

    async def OpenSession(self, request, context):  # noqa: N802
        self.sessions[request.session_id] = request.owner
        return scheduler_pb2.SessionAck()

    async def CloseSession(self, request, context):  # noqa: N802
        self.sessions.pop(request.session_id)
        return scheduler_pb2.SessionAck()


class Replicas:
    def __init__(self) -> None:
        self.detokenizer = FakeDetokenizer()
        self.schedulers = [FakeSessionScheduler(self.detokenizer) for _ in range(2)]
        self.servers = [grpc.aio.server() for _ in self.schedulers]
        self.addrs = []
        for fake, server in zip(self.schedulers, self.servers, strict=True):
            scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(fake, server)
            self.addrs.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(
            self.detokenizer, self.servers[0]
        )
        self.manager = TokenizerManager("fe-test", self.addrs, self.addrs[0])

    def holder(self, session_id: str) -> FakeSessionScheduler:
        (fake,) = [s for s in self.schedulers if session_id in s.sessions]
        return fake

    async def run_in(self, session_id: str, rid: str) -> None:
        request = TokenizedRequest(
            rid, [5, 6], SamplingParams(), session=session_pb2.SessionParams(id=session_id)
        )
        rows = [row async for _, row in self.manager.generate([request])]
        assert rows[-1].HasField("finish_reason")


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    r = Replicas()
    for server in r.servers:
        await server.start()
    r.manager.start()
    await eventually(lambda: all(map(r.manager.router.is_leased, r.addrs)), timeout=10)
    await eventually(lambda: r.manager.can_serve, timeout=10)
    yield r
    await r.manager.close()
    for server in r.servers:
        await server.stop(None)


async def test_every_request_of_a_session_goes_to_the_replica_holding_it(
    replicas: Replicas,
) -> None:
    sessions = replicas.manager.sessions
    ids = [await sessions.open("", capacity=100) for _ in range(2)]
    holders = [replicas.holder(s) for s in ids]
    assert holders[0] is not holders[1]  # the router spread them; now each must stick
    assert all(h.sessions[s] == "fe-test" for h, s in zip(holders, ids, strict=True))
    for turn in range(3):
        for session_id in ids:
            await replicas.run_in(session_id, f"{session_id}-{turn}")
    for holder, session_id in zip(holders, ids, strict=True):
        assert sorted(holder.session_of.values()) == [session_id] * 3


async def test_open_and_close_are_checked_and_reach_the_holder(replicas: Replicas) -> None:
    sessions = replicas.manager.sessions
    assert await sessions.open("mine", capacity=10) == "mine"
    with pytest.raises(AlreadyExistsError):
        await sessions.open("mine", capacity=10)
    with pytest.raises(InvalidArgumentError) as err:
        await sessions.open("other", capacity=0)
    assert err.value.field == "capacity_of_str_len"
    holder = replicas.holder("mine")
    await sessions.close("mine")
    assert "mine" not in holder.sessions
    with pytest.raises(InvalidArgumentError) as err:
        await sessions.close("mine")
    assert err.value.field == "session_id"
    with pytest.raises(InvalidArgumentError) as err:
        await replicas.run_in("mine", "late")
    assert err.value.field == "session_params.id"
    assert all("late" not in s.received for s in replicas.schedulers)  # refused before dispatch


async def test_a_lost_lease_forgets_the_sessions_on_that_replica(replicas: Replicas) -> None:
    sessions = replicas.manager.sessions
    ids = [await sessions.open("", capacity=100) for _ in range(2)]
    lost = replicas.holder(ids[0])
    lost.lease_ended.set()
    await eventually(lambda: len(sessions) == 1, timeout=10)
    with pytest.raises(InvalidArgumentError) as err:
        sessions.scheduler_of(ids[0])
    assert err.value.field == "session_params.id"
    await replicas.run_in(ids[1], "still-served")
