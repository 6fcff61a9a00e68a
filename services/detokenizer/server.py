"""Detokenizer gRPC shell: schedulers push per-step batches in, frontends
subscribe and receive the rows they own."""

from __future__ import annotations

import asyncio
import logging

from tokenline.v1 import detokenizer_pb2, detokenizer_pb2_grpc

from services.common.errors import grpc_errors
from services.detokenizer.manager import DetokenizerManager

logger = logging.getLogger(__name__)

_SUBSCRIBER_QUEUE_SIZE = 4096


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self, manager: DetokenizerManager) -> None:
        self.manager = manager
        self.subscribers: dict[str, asyncio.Queue[detokenizer_pb2.BatchStrOutput]] = {}

    @grpc_errors
    async def PushTokenBatches(self, request_iterator, context):  # noqa: N802
        num_batches = 0
        async for batch in request_iterator:
            num_batches += 1
            # Decoding is CPU work on the event loop; it is short per step and the
            # loop has nothing else to do but forward the result.
            for frontend_id, rows in self.manager.handle_batch(batch).items():
                await self._route(frontend_id, rows)
        return detokenizer_pb2.PushAck(num_batches=num_batches)

    async def Subscribe(self, request, context):  # noqa: N802
        frontend_id = request.frontend_id
        queue: asyncio.Queue[detokenizer_pb2.BatchStrOutput] = asyncio.Queue(_SUBSCRIBER_QUEUE_SIZE)
        self.subscribers[frontend_id] = queue
        # Headers now, so the frontend knows it is subscribed before any row exists.
        await context.send_initial_metadata(())
        logger.info("frontend %s subscribed", frontend_id)
        try:
            while True:
                yield await queue.get()
        finally:
            if self.subscribers.get(frontend_id) is queue:
                del self.subscribers[frontend_id]
            logger.info("frontend %s unsubscribed", frontend_id)

    @grpc_errors
    async def GetInfo(self, request, context):  # noqa: N802
        return detokenizer_pb2.DetokenizerInfo(
            num_live_states=len(self.manager.states),
            num_dropped_rows=self.manager.num_dropped_rows,
            num_subscribers=len(self.subscribers),
        )

    async def _route(self, frontend_id: str, rows: list[detokenizer_pb2.StrRow]) -> None:
        queue = self.subscribers.get(frontend_id)
        if queue is None:
            self.manager.num_dropped_rows += len(rows)
            logger.warning("no subscriber %r; dropped %d rows", frontend_id, len(rows))
            return
        await queue.put(detokenizer_pb2.BatchStrOutput(rows=rows))
