"""Attention with FlashAttention's varlen kernel (vllm-flash-attn or flash-attn), CUDA only.

The kernel is an optional dependency: it is imported when the backend is built,
and a missing package or device is an error at start-up, never mid-request.

Each step gathers every request's KV from the token-granular pool into one packed
tensor and runs a single varlen call with ``causal=True``; FlashAttention >= 2.1
aligns the causal mask to the bottom-right, which is exactly "new tokens see the
cached prefix plus themselves". A paged call (block_table at page size 1) would
skip the gather, but not every kernel build accepts page size 1.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.model_executor.forward_batch import ForwardBatch

# Tried in order; all expose flash_attn_varlen_func with the same keyword arguments.
_KERNEL_MODULES = ("vllm_flash_attn", "vllm.vllm_flash_attn", "flash_attn")


def load_varlen_kernel() -> Callable[..., Any]:
    """Import ``flash_attn_varlen_func`` from the first installed package, or explain."""
    errors = []
    for module_name in _KERNEL_MODULES:
        try:
            module = importlib.import_module(module_name)
            return module.flash_attn_varlen_func  # type: ignore[no-any-return]
        except (ImportError, AttributeError) as exc:
            errors.append(f"{module_name}: {exc}")
    raise RuntimeError(
        "attention backend 'flash_attn' needs vllm-flash-attn or flash-attn installed "
        f"({'; '.join(errors)}); use --attention-backend torch instead"
    )


@dataclass(slots=True)
class FlashAttnMetadata(AttentionMetadata):
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, offsets of each request's new tokens
    cu_seqlens_k: torch.Tensor  # [B + 1] int32, offsets of each request's full context
    max_seqlen_q: int
    max_seqlen_k: int
    kv_slots: torch.Tensor  # [sum(seq_lens)] every request's slots, concatenated
    window: int | None = None  # keys per query under a sliding window; None = all


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(
                f"attention backend 'flash_attn' needs a CUDA device, got {device} "
                f"(cuda available: {torch.cuda.is_available()}); use --attention-backend torch"
            )
        self._varlen = load_varlen_kernel()

    def plan(self, batch: ForwardBatch, window: int | None = None) -> FlashAttnMetadata:
        device = batch.input_ids.device
        return FlashAttnMetadata(
            batch=batch,
            cu_seqlens_q=_cumulative(batch.extend_lens, device),
            cu_seqlens_k=_cumulative(batch.seq_lens, device),
            max_seqlen_q=max(batch.extend_lens, default=0),
            max_seqlen_k=max(batch.seq_lens, default=0),
            kv_slots=torch.cat(batch.kv_slots) if batch.kv_slots else batch.out_cache_loc,
            window=window,
        )

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
        if not isinstance(meta, FlashAttnMetadata):
            raise TypeError("FlashAttnBackend needs metadata from its own plan()")
        kv_pool.write(layer, meta.batch.out_cache_loc, k, v)
        packed_k = kv_pool.k_buffers[layer][meta.kv_slots].to(q.dtype)
        packed_v = kv_pool.v_buffers[layer][meta.kv_slots].to(q.dtype)
        out: torch.Tensor = self._varlen(
            q=q.contiguous(),
            k=packed_k,
            v=packed_v,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            # (left, right) keys beside the diagonal; the kernel's own sliding window
            window_size=(-1, -1) if meta.window is None else (meta.window - 1, 0),
        )
        return out


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return torch.tensor(offsets, dtype=torch.int32, device=device)
