"""SchedulerRouter's leases and its view of the replicas (load, dtype), over real gRPC.

The schedulers here are fakes that answer Attach only, beating with whatever load
the test sets: this is a unit test of the router, the layer above them. The real
scheduler's side of the lease is tested in tests/scheduler/transport/test_servicer.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.frontend.dispatch.router import SchedulerRouter
from tests.waiting import eventually


class BeatingScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, dtype: str, num_running: int = 0) -> None:
        self.dtype = dtype
        self.num_running = num_running
        self.num_accepted = 0
        self.num_beats = 0
        self.attached: list[str] = []  # frontend ids, one per Attach call
        self.silent = False  # stop beating without ending the stream
        self.end_lease = asyncio.Event()
        self.beat_interval = 0.02

    async def Attach(self, request_iterator, context):  # noqa: N802
        self.attached.append((await context.read()).frontend_id)
        while not self.end_lease.is_set():
            if not self.silent:
                info = scheduler_pb2.SchedulerInfo(model="m", dtype=self.dtype)
                info.num_running = self.num_running
                beat = scheduler_pb2.SchedulerBeat(info=info, num_accepted=self.num_accepted)
                await context.write(beat)
                self.num_beats += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.end_lease.wait(), self.beat_interval)


@contextlib.asynccontextmanager
async def serving(
    fakes: list[BeatingScheduler],
) -> AsyncIterator[dict[str, scheduler_pb2_grpc.SchedulerServiceStub]]:
    """Each fake on its own real grpc.aio server; stubs by address, in order."""
    servers, channels, stubs = [], [], {}
    try:
        for fake in fakes:
            server = grpc.aio.server()
            scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(fake, server)
            addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            servers.append(server)
            channels.append(grpc.aio.insecure_channel(addr))
            stubs[addr] = scheduler_pb2_grpc.SchedulerServiceStub(channels[-1])
        yield stubs
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop(None)


@contextlib.asynccontextmanager
async def started(router: SchedulerRouter) -> AsyncIterator[SchedulerRouter]:
    router.start()
    try:
        yield router
    finally:
        await router.close()


async def test_load_counts_a_dispatched_request_once_before_and_after_a_beat_sees_it() -> None:
    fakes = [BeatingScheduler("float32"), BeatingScheduler("float32")]
    async with serving(fakes) as stubs, started(SchedulerRouter(stubs, "fe")) as router:
        a, b = stubs
        await eventually(lambda: router.is_up(a) and router.is_up(b))
        for _ in range(3):
            router.dispatched(a)
        assert (router.load(a), router.load(b)) == (3, 0)  # before any beat counts them
        assert router.pick() == b
        fakes[0].num_running, fakes[0].num_accepted = 3, 3  # the replica now holds the three
        beats = fakes[0].num_beats
        await eventually(lambda: fakes[0].num_beats >= beats + 2)  # one has surely arrived
        assert router.load(a) == 3  # counted once, not beat + dispatched
        router.dispatched(b)
        router.refused(b)  # turned away: it never held it
        assert router.load(b) == 0
        fakes[0].num_running = 0  # they finished
        await eventually(lambda: router.load(a) == 0)
        assert fakes[0].attached == ["fe"] and fakes[1].attached == ["fe"]


async def test_a_lost_lease_calls_on_down_and_comes_back() -> None:
    fakes = [BeatingScheduler("float32")]
    downs: list[str] = []
    async with serving(fakes) as stubs:
        (addr,) = stubs
        router = SchedulerRouter(stubs, "fe", on_down=downs.append, beat_timeout=0.3)
        async with started(router):
            await eventually(router.any_answering)
            fakes[0].end_lease.set()  # the scheduler ends the lease
            await eventually(lambda: not router.any_answering())
            assert downs == [addr]
            fakes[0].end_lease.clear()
            await eventually(router.any_answering)  # a new lease
            fakes[0].silent = True  # beats stop, the stream stays open
            await eventually(lambda: not router.any_answering(), timeout=2.0)
            assert downs == [addr, addr]
            await eventually(lambda: len(fakes[0].attached) >= 3)  # it tries again


async def test_served_dtype_joins_the_replicas_differences() -> None:
    fakes = [BeatingScheduler(dtype) for dtype in ("float32", "bfloat16", "bfloat16")]
    async with serving(fakes) as stubs, started(SchedulerRouter(stubs, "fe")) as router:
        await eventually(lambda: all(router.is_leased(a) for a in stubs))
        assert router.served_dtype() == "bfloat16,float32"


class CountingStub:
    """A scheduler stub that counts the router's Attach calls."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub) -> None:
        self.stub = stub
        self.num_attaches = 0

    def Attach(self, *args, **kwargs):  # noqa: N802
        self.num_attaches += 1
        return self.stub.Attach(*args, **kwargs)


async def test_nothing_is_up_while_no_replica_answers() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # nothing listens there
    try:
        stub = CountingStub(scheduler_pb2_grpc.SchedulerServiceStub(channel))
        stubs = {"127.0.0.1:1": stub}
        async with started(SchedulerRouter(stubs, "fe")) as router:
            # A second Attach means the first one has failed and been handled.
            await eventually(lambda: stub.num_attaches >= 2)
            assert router.served_dtype() == "" and not router.any_answering()
    finally:
        await channel.close()


async def test_close_ends_leases_whose_beats_are_arriving() -> None:
    """A lease task cancelled while it awaits a beat waits for grpc's read to give up,
    and a read cancelled just as its beat arrives gave up only when its call ended, so
    close() hung (as the frontend's exit after a drain did) unless it ends the calls. The
    race is per close: fast beats and rounds of start and close make a regression show."""
    fake = BeatingScheduler("float32")
    fake.beat_interval = 0.001
    async with serving([fake]) as stubs:
        (addr,) = stubs
        for _ in range(20):
            await lease_then_close(SchedulerRouter(stubs, "fe"), addr)


async def lease_then_close(router: SchedulerRouter, addr: str) -> None:
    router.start()
    await eventually(lambda: router.is_up(addr))
    # The bound only turns a hang into a failure here.
    await asyncio.wait_for(router.close(), 30)
    assert all(task.done() for task in router._tasks)
