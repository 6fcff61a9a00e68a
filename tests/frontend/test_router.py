"""SchedulerRouter's view of the replicas (load, dtype) from GetInfo answers over real gRPC.

The schedulers here are fakes that answer GetInfo only: this is a unit test of the
router, the layer above them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.frontend.router import SchedulerRouter


class InfoOnlyScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, dtype: str, num_running: int = 0) -> None:
        self.dtype = dtype
        self.num_running = num_running

    async def GetInfo(self, request, context):  # noqa: N802
        info = scheduler_pb2.SchedulerInfo(model="m", dtype=self.dtype)
        info.num_running = self.num_running
        return info


@contextlib.asynccontextmanager
async def serving(
    fakes: list[InfoOnlyScheduler],
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


async def test_load_counts_a_dispatched_request_once_before_and_after_a_poll_sees_it() -> None:
    fakes = [InfoOnlyScheduler("float32"), InfoOnlyScheduler("float32")]
    async with serving(fakes) as stubs:
        a, b = stubs
        router = SchedulerRouter(stubs)  # not started: polls happen only on refresh()
        await router.refresh()
        for _ in range(3):
            router.dispatched(a)
        assert (router.load(a), router.load(b)) == (3, 0)  # before any poll sees them
        assert router.pick() == b
        fakes[0].num_running = 3  # the replica now holds the three
        await router.refresh()
        assert router.load(a) == 3  # counted once, not polled + dispatched
        router.dispatched(b)
        router.refused(b)  # turned away: it never held it
        assert router.load(b) == 0
        fakes[0].num_running = 0  # they finished
        await router.refresh()
        assert router.load(a) == 0


async def test_served_dtype_asks_replicas_before_the_first_poll_and_joins_differences() -> None:
    fakes = [InfoOnlyScheduler(dtype) for dtype in ("float32", "bfloat16", "bfloat16")]
    async with serving(fakes) as stubs:
        router = SchedulerRouter(stubs)  # not started: no polling loop
        assert await router.served_dtype() == "bfloat16,float32"


async def test_served_dtype_is_empty_while_no_replica_answers() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # nothing listens there
    try:
        stubs = {"127.0.0.1:1": scheduler_pb2_grpc.SchedulerServiceStub(channel)}
        assert await SchedulerRouter(stubs).served_dtype() == ""
    finally:
        await channel.close()
