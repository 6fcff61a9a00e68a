"""The contract between the model and an attention kernel.

The model computes q/k/v and hands them to a backend together with per-step
metadata the backend planned once for the whole batch (``ModelRunner`` asks for the
plan). The backend stores the new K/V in the pool and attends over each request's
full context, so the model never knows how KV is laid out or which kernel runs.

A backend owns its kernel and the index tensors of its plan; the slots it writes and
reads belong to the scheduler, which hands them over in the ``ForwardBatch``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.forward_batch import ForwardBatch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step state a backend derives from a batch; shared by every layer of one forward."""

    batch: ForwardBatch


class AttentionBackend(ABC):
    """Causal attention over a ForwardBatch whose KV lives in a KVPool.

    Semantics every backend implements: new token ``j`` of request ``i`` (absolute
    position ``p``) attends to the request's KV at positions ``0..p``, i.e. its cached
    prefix plus new tokens up to itself (the last ``window`` of them under a window
    plan). Results must agree with the ``torch`` backend to floating-point tolerance.
    """

    name: str

    @abstractmethod
    def plan(self, batch: ForwardBatch, window: int | None = None) -> AttentionMetadata:
        """Derive index tensors and masks for ``batch``; called once per forward step and
        attention window, before any layer runs.

        With a ``window``, the token at position ``p`` attends only to positions
        ``p - window + 1 .. p`` (HF's sliding window: the last ``window`` keys, itself
        included); a layer with that window is handed this plan."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layer: int,
        meta: AttentionMetadata,
        kv_pool: KVPool,
        scale: float,
    ) -> torch.Tensor:
        """Write ``k``/``v`` ([T, kv_heads, D]) into ``kv_pool`` at ``meta.batch.out_cache_loc``
        for ``layer``, then return attention output [T, heads, D] for ``q`` ([T, heads, D]).

        Only writes the slots in ``out_cache_loc``; reads only the requests' ``kv_slots``.
        """
