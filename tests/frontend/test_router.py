"""SchedulerRouter's view of the replicas' dtype, from their real GetInfo answers."""

from __future__ import annotations

import grpc
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.frontend.router import SchedulerRouter


class InfoOnlyScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype

    async def GetInfo(self, request, context):  # noqa: N802
        return scheduler_pb2.SchedulerInfo(model="m", dtype=self.dtype)


async def test_served_dtype_asks_replicas_before_the_first_poll_and_joins_differences() -> None:
    servers, channels, stubs = [], [], {}
    for dtype in ("float32", "bfloat16", "bfloat16"):
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(InfoOnlyScheduler(dtype), server)
        addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        channel = grpc.aio.insecure_channel(addr)
        servers.append(server)
        channels.append(channel)
        stubs[addr] = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    router = SchedulerRouter(stubs)  # not started: no polling loop
    try:
        assert await router.served_dtype() == "bfloat16,float32"
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop(None)


async def test_served_dtype_is_empty_while_no_replica_answers() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # nothing listens there
    try:
        stubs = {"127.0.0.1:1": scheduler_pb2_grpc.SchedulerServiceStub(channel)}
        assert await SchedulerRouter(stubs).served_dtype() == ""
    finally:
        await channel.close()
