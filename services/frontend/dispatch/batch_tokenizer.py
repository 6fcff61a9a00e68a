"""DynamicBatchTokenizer: concurrent encode requests become one tokenizer call.

Why: a fast (Rust) tokenizer's batch call releases the GIL and encodes its texts
in parallel, so N prompts encoded in one call on a worker thread cost less than
N calls on the event loop, and the loop keeps serving RPCs meanwhile.

Policy: a request that arrives after at least ``window_s`` of quiet (no other
request waiting, no batch sent within the window) is encoded at once, so an
idle server adds no latency. Otherwise the batch gathers until it holds
``max_batch_size`` texts, its oldest request is ``window_s`` old, or nothing new
arrived for a quarter window (the burst is over: waiting longer only adds
latency). SGLang's batcher skips the wait only when its queue is empty, which
lets a burst that trickles in through gRPC go nearly one by one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class _Pending:
    text: str
    add_special_tokens: bool
    future: asyncio.Future[list[int]]
    arrival: float


class DynamicBatchTokenizer:
    """Owns the tokenizer's worker thread; every tokenizer call of the frontend
    that may take long goes through it, one call at a time.

    ``num_calls`` counts calls into the tokenizer, ``num_requests`` the texts
    (or single jobs) they served: ``num_requests / num_calls`` is the mean batch.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        window_s: float = 0.002,
        max_batch_size: int = 64,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.tokenizer = tokenizer
        self.window_s = window_s
        self.max_batch_size = max_batch_size
        self.num_calls = 0
        self.num_requests = 0
        self._on_batch = on_batch
        # One worker: calls never overlap on the tokenizer, and the next batch
        # grows while the current one encodes.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._pending: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._in_flight: list[_Pending] = []
        self._last_sent = -math.inf  # loop time the latest batch went to the tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, exactly as ``tokenizer(text)`` would give them."""
        loop = asyncio.get_running_loop()
        self._ensure_running()
        future: asyncio.Future[list[int]] = loop.create_future()
        self._pending.append(_Pending(text, add_special_tokens, future, loop.time()))
        self._wakeup.set()
        self._arrived.set()
        return await future

    async def encode_many(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Several texts of one request; they join the same batch as everyone else's."""
        return list(await asyncio.gather(*(self.encode(t, add_special_tokens) for t in texts)))

    async def run(self, job: Callable[[], T]) -> T:
        """Run one non-batchable tokenizer job (e.g. a tokenizing chat template)
        on the worker thread, counted as one call serving one request."""
        result = await asyncio.get_running_loop().run_in_executor(self._executor, job)
        self.num_calls += 1
        self.num_requests += 1
        return result

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for item in [*self._in_flight, *self._pending]:
            if not item.future.done():
                item.future.set_exception(RuntimeError("tokenizer closed"))
        self._in_flight, self._pending = [], deque()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- the batching loop ----------------------------------------------------

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="batch-tokenizer")

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not self._is_quiet():
                await self._gather_window()
            self._in_flight = self._take_batch()
            self._last_sent = asyncio.get_running_loop().time()
            await self._encode_batch(self._in_flight)
            self._in_flight = []

    def _is_quiet(self) -> bool:
        """One request waiting, and the previous batch went out over a window ago."""
        oldest = self._pending[0].arrival
        return len(self._pending) == 1 and oldest - self._last_sent >= self.window_s

    async def _gather_window(self) -> None:
        """Wait for more requests: until full, window elapsed, or a quiet quarter window."""
        loop = asyncio.get_running_loop()
        deadline = self._pending[0].arrival + self.window_s
        while len(self._pending) < self.max_batch_size:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(remaining, self.window_s / 4))
            except TimeoutError:
                return

    def _take_batch(self) -> list[_Pending]:
        batch: list[_Pending] = []
        while self._pending and len(batch) < self.max_batch_size:
            item = self._pending.popleft()
            if not item.future.done():  # skip callers that were cancelled meanwhile
                batch.append(item)
        return batch

    async def _encode_batch(self, batch: list[_Pending]) -> None:
        for flag in (False, True):
            group = [p for p in batch if p.add_special_tokens is flag]
            if not group:
                continue
            try:
                ids = await self._call_counted([p.text for p in group], flag)
            except Exception:  # noqa: BLE001 - one bad text must not fail its batch-mates
                await self._encode_one_by_one(group, flag)
                continue
            for item, item_ids in zip(group, ids, strict=True):
                if not item.future.done():
                    item.future.set_result(item_ids)

    async def _encode_one_by_one(self, group: list[_Pending], flag: bool) -> None:
        for item in group:
            try:
                (ids,) = await self._call_counted([item.text], flag)
            except Exception as exc:  # noqa: BLE001 - the caller gets the tokenizer's error
                logger.warning("tokenizer call failed: %s", type(exc).__name__)
                if not item.future.done():
                    item.future.set_exception(exc)
                continue
            if not item.future.done():
                item.future.set_result(ids)

    async def _call_counted(self, texts: list[str], flag: bool) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        ids = await loop.run_in_executor(self._executor, self._call, texts, flag)
        self.num_calls += 1
        self.num_requests += len(texts)
        if self._on_batch is not None:
            self._on_batch(len(texts), time.perf_counter() - start)
        return ids

    def _call(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        encoded: Any = self.tokenizer(
            texts,
            add_special_tokens=add_special_tokens,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return [list(ids) for ids in encoded["input_ids"]]
