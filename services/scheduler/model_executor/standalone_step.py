"""One standalone forward step of either model path, for tests and tools.

Serving goes through ``ModelRunner``, which plans the batch itself and runs the LM head only
on the rows it samples; a parity test or a tool wants the logits of a ``ForwardBatch`` in
one call, the same way whichever path (native or transformers) computes the model.
"""

from __future__ import annotations

import torch
from torch import nn

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.model_executor.forward_batch import ForwardBatch


class StandaloneStep(nn.Module):
    """``model(batch, kv_pool)``: logits of a step, over ``hidden_states`` and
    ``compute_logits``, which each path defines."""

    attn_backend: AttentionBackend

    def hidden_states(
        self, batch: ForwardBatch, meta: AttentionMetadata, kv_pool: KVPool
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_pool: KVPool, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Float32 logits [num_reqs, vocab] for each request's last new token, or
        [num_tokens, vocab] for every new token when ``all_logits``."""
        hidden = self.hidden_states(batch, self.attn_backend.plan(batch), kv_pool)
        if not all_logits:
            last_rows = torch.tensor(batch.extend_lens, dtype=torch.int64, device=hidden.device)
            hidden = hidden[last_rows.cumsum(0) - 1]
        return self.compute_logits(hidden).float()
