"""DetokenizerPusher delivers every step's rows, in order, across reconnects.

The detokenizer here is a recording fake (this is a unit test of the layer
above it): a real grpc.aio server that starts late and drops the first stream.
"""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field

import grpc
from tokenline.v1 import detokenizer_pb2, detokenizer_pb2_grpc

from services.launch import free_port
from services.scheduler.detokenizer_pusher import DetokenizerPusher
from services.scheduler.engine import OutputRow
from tests.scheduler.factories import make_req


@dataclass
class FakeEngineOutbox:
    outbox: queue.Queue = field(default_factory=lambda: queue.Queue(256))
    abort_reasons: list[str] = field(default_factory=list)

    def abort_started(self, reason: str) -> None:
        self.abort_reasons.append(reason)


class RecordingDetokenizer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self, drop_first_stream_after: int) -> None:
        self.rids: list[str] = []
        self.streams = 0
        self.drop_after = drop_first_stream_after

    async def PushTokenBatches(self, request_iterator, context):  # noqa: N802
        self.streams += 1
        async for batch in request_iterator:
            self.rids.extend(row.rid for row in batch.rows)
            if self.streams == 1 and len(self.rids) >= self.drop_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "simulated restart")
        return detokenizer_pb2.PushAck()


async def test_nothing_is_lost_before_connect_and_a_broken_stream_aborts_its_requests() -> None:
    engine = FakeEngineOutbox()
    port = free_port()
    pusher = DetokenizerPusher(engine, f"127.0.0.1:{port}")  # type: ignore[arg-type]
    expected = [f"r{i}" for i in range(30)]
    for rid in expected[:10]:  # produced while no detokenizer listens
        engine.outbox.put([OutputRow(make_req(rid, [1, 2]), [5], None)])
    pusher.start()
    await asyncio.sleep(1.0)
    server = grpc.aio.server()
    recorder = RecordingDetokenizer(drop_first_stream_after=12)
    detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(recorder, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    for rid in expected[10:]:
        engine.outbox.put([OutputRow(make_req(rid, [1, 2]), [5], None)])
    await pusher.close(timeout=20)
    await server.stop(0)
    assert recorder.streams >= 2
    # Rows produced while nothing listened all arrive, first and in order.
    assert recorder.rids[:10] == expected[:10]
    # After the break, whatever arrives is in order and never twice ...
    assert recorder.rids == sorted(set(recorder.rids), key=expected.index)
    assert recorder.rids[-1] == expected[-1]
    # ... and the requests the broken stream carried are aborted, not left hanging.
    assert engine.abort_reasons == ["detokenizer stream lost"]
