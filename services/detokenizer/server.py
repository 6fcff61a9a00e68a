"""Detokenizer gRPC shell: schedulers push per-step batches in, frontends
subscribe and receive the rows they own."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from tokenline.v1 import detokenizer_pb2, detokenizer_pb2_grpc

from services.common.errors import SCHEDULER_STREAM_ENDED, InvalidArgumentError, grpc_errors
from services.detokenizer.manager import DetokenizerManager, Routed

logger = logging.getLogger(__name__)

_SUBSCRIBER_QUEUE_SIZE = 4096
# Put on a replaced subscriber's queue: its stream ends instead of waiting forever.
_CLOSED = detokenizer_pb2.BatchStrOutput()


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(
        self,
        manager: DetokenizerManager,
        on_batch: Callable[[int, float], None] | None = None,
        metrics_port: int = 0,
    ) -> None:
        self.manager = manager
        self.on_batch = on_batch  # (rows, seconds) for each decoded scheduler step
        self.metrics_port = metrics_port  # reported by GetInfo: where Prometheus scrapes
        self.subscribers: dict[str, asyncio.Queue[detokenizer_pb2.BatchStrOutput]] = {}
        self._stream_ids = itertools.count(1)

    @grpc_errors
    async def PushTokenBatches(self, request_iterator, context):  # noqa: N802
        source = f"push-{next(self._stream_ids)}"
        num_batches = 0
        try:
            async for batch in request_iterator:
                num_batches += 1
                # Decoding is CPU work on the event loop; it is short per step and the
                # loop has nothing else to do but forward the result.
                start = time.perf_counter()
                routed = self.manager.handle_batch(batch, source)
                if self.on_batch is not None:
                    self.on_batch(len(batch.rows), time.perf_counter() - start)
                await self._route(routed)
        finally:
            # Rows of this stream's live requests may be lost with it: end them now
            # (without waiting: the handler may be cancelled).
            released = self.manager.release_source(source, SCHEDULER_STREAM_ENDED)
            await self._route(released, wait=False)
        return detokenizer_pb2.PushAck(num_batches=num_batches)

    @grpc_errors
    async def Subscribe(self, request, context):  # noqa: N802
        frontend_id = request.frontend_id
        if not frontend_id:
            raise InvalidArgumentError("must be non-empty", field="frontend_id")
        queue: asyncio.Queue[detokenizer_pb2.BatchStrOutput] = asyncio.Queue(_SUBSCRIBER_QUEUE_SIZE)
        previous = self.subscribers.get(frontend_id)
        if previous is not None:
            self._close(previous)
        self.subscribers[frontend_id] = queue
        # Headers now, so the frontend knows it is subscribed before any row exists.
        await context.send_initial_metadata(())
        logger.info("frontend %s subscribed", frontend_id)
        try:
            while (batch := await queue.get()) is not _CLOSED:
                yield batch
        finally:
            if self.subscribers.get(frontend_id) is queue:
                del self.subscribers[frontend_id]
            logger.info("frontend %s unsubscribed", frontend_id)

    @grpc_errors
    async def GetInfo(self, request, context):  # noqa: N802
        stats = self.manager.stats
        return detokenizer_pb2.DetokenizerInfo(
            num_live_states=len(self.manager.states),
            num_dropped_rows=stats.num_dropped_rows,
            num_subscribers=len(self.subscribers),
            num_refused_requests=stats.num_refused_requests,
            num_unstable_decodes=stats.num_unstable_decodes,
            num_duplicate_rids=stats.num_duplicate_rids,
            metrics_port=self.metrics_port,
        )

    async def _route(self, routed: Routed, *, wait: bool = True) -> None:
        """Queue each frontend's rows; a full queue makes the scheduler stream wait."""
        for frontend_id, batch in routed.items():
            queue = self.subscribers.get(frontend_id)
            if queue is not None and wait:
                await queue.put(batch)
            elif queue is not None and not queue.full():
                queue.put_nowait(batch)
            else:
                self.manager.stats.num_dropped_rows += len(batch.rows)
                logger.warning(
                    "no room for frontend %r; dropped %d rows", frontend_id, len(batch.rows)
                )

    def close_subscriptions(self) -> None:
        """End every Subscribe stream (drain): frontends see the stream finish."""
        for queue in list(self.subscribers.values()):
            self._close(queue)

    def _close(self, queue: asyncio.Queue[detokenizer_pb2.BatchStrOutput]) -> None:
        """End a replaced subscription; rows still queued for it are dropped and counted."""
        while not queue.empty():
            self.manager.stats.num_dropped_rows += len(queue.get_nowait().rows)
        queue.put_nowait(_CLOSED)
