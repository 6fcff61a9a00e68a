"""DetokenizerPusher delivers every step's rows, in order, across reconnects.

The detokenizer here is a recording fake (this is a unit test of the layer
above it): a real grpc.aio server that starts late and drops the first stream.
Rows are published from a worker thread, as the engine thread does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
from tokenline.v1 import detokenizer_pb2, detokenizer_pb2_grpc

from services.launch import free_port
from services.scheduler.core.output_row import OutputRow
from services.scheduler.transport.detokenizer_pusher import MAX_UNSENT_STEPS, DetokenizerPusher
from tests.scheduler.factories import make_req
from tests.waiting import eventually


class RecordingDetokenizer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self, drop_first_stream_after: int) -> None:
        self.rids: list[str] = []
        self.streams = 0
        self.drop_after = drop_first_stream_after
        self.dropped = False

    async def PushTokenBatches(self, request_iterator, context):  # noqa: N802
        self.streams += 1
        async for batch in request_iterator:
            self.rids.extend(row.rid for row in batch.rows)
            if self.streams == 1 and len(self.rids) >= self.drop_after:
                self.dropped = True
                await context.abort(grpc.StatusCode.UNAVAILABLE, "simulated restart")
        return detokenizer_pb2.PushAck()


def row(rid: str) -> list[OutputRow]:
    return [OutputRow.of(make_req(rid, [1, 2]), [5], None)]


async def test_nothing_is_lost_before_connect_and_a_broken_stream_aborts_its_requests() -> None:
    abort_reasons: list[str] = []
    port = free_port()
    pusher = DetokenizerPusher(f"127.0.0.1:{port}", on_stream_lost=abort_reasons.append)
    expected = [f"r{i}" for i in range(30)]
    pusher.start()
    # Produced on the engine thread while no detokenizer listens: publish blocks past
    # max_unsent steps, so it runs on a thread as the engine would.
    progress = Progress()
    early = asyncio.create_task(asyncio.to_thread(publish_all, pusher, expected[:10], progress))
    await eventually(lambda: progress.started == MAX_UNSENT_STEPS + 1)
    assert progress.returned == MAX_UNSENT_STEPS  # the first max_unsent went through
    # The step past max_unsent must not return. Nothing shows "blocked" from outside, so
    # this is a bounded wait: with room, publish returns at once; without, it keeps
    # retrying every 0.2 s.
    await asyncio.sleep(0.5)
    assert progress.returned == MAX_UNSENT_STEPS and not early.done()
    server = grpc.aio.server()
    recorder = RecordingDetokenizer(drop_first_stream_after=12)
    detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(recorder, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await early
    await asyncio.to_thread(publish_all, pusher, expected[10:20])
    # Rows published after the break must go out on a new stream. (Published before it,
    # the rest could all be in the first stream's transport when it broke, and be lost
    # with it, leaving nothing for a second stream.)
    await eventually(lambda: recorder.dropped, timeout=30, what="the first stream's drop")
    await asyncio.to_thread(publish_all, pusher, expected[20:])
    await pusher.close(timeout=20)
    await server.stop(0)
    assert pusher.is_flushed
    assert recorder.streams >= 2
    # Rows produced while nothing listened all arrive, first and in order.
    assert recorder.rids[:10] == expected[:10]
    # After the break, whatever arrives is in order and never twice ...
    assert recorder.rids == sorted(set(recorder.rids), key=expected.index)
    assert recorder.rids[-1] == expected[-1]
    # ... and the requests the broken stream carried are aborted, not left hanging.
    assert abort_reasons == ["detokenizer stream lost"]


@dataclass
class Progress:
    """How far a publishing thread got (it alone writes): publish calls entered and returned."""

    started: int = 0
    returned: int = 0


def publish_all(
    pusher: DetokenizerPusher, rids: list[str], progress: Progress | None = None
) -> None:
    progress = progress or Progress()
    for rid in rids:
        progress.started += 1
        pusher.publish(row(rid))
        progress.returned += 1
