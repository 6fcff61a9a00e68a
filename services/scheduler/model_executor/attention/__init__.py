"""Attention backends: ``torch`` (SDPA, CPU and GPU) and ``flash_attn`` (CUDA only)."""

from __future__ import annotations

import torch

from services.scheduler.model_executor.attention.base import AttentionBackend, AttentionMetadata

ATTENTION_BACKENDS = ("torch", "flash_attn")


def create_attention_backend(
    name: str,
    device: torch.device | str,
    batch_invariant: bool = False,
    decode_kernel: bool = False,
) -> AttentionBackend:
    """Build the named backend for ``device``; raises ValueError/RuntimeError if unusable
    (``flash_attn`` splits long contexts by batch size, so it refuses ``batch_invariant``).
    ``decode_kernel``: the compiled CPU decode kernel is loaded (only ``torch`` uses it)."""
    if name == "torch":
        from services.scheduler.model_executor.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(batch_invariant, decode_kernel)
    if batch_invariant:
        raise ValueError(f"--batch-invariant needs --attention-backend torch, not {name!r}")
    if name == "flash_attn":
        from services.scheduler.model_executor.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "create_attention_backend",
]
