"""What every native architecture shares above its layers: the LM head, the RoPE tables,
the per-window attention plans of a step, and how HF checkpoint names map onto fused and
stacked parameters (the loader reads those maps; it knows no architecture).

Owns the network: its weights, the rotary tables and the attention backend its layers call
(chosen at load). It does not decide which rows become logits or build a step's tensors:
``ModelRunner`` does, through ``hidden_states`` and ``compute_logits``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.layers import (
    GLOBAL_ROPE,
    LOCAL_ROPE,
    DecoderModel,
    RotaryEmbedding,
    StepContext,
)
from services.scheduler.model_executor.models.linear import Linear
from services.scheduler.model_executor.models.rope import RopeScaling
from services.scheduler.model_executor.standalone_step import StandaloneStep


class NativeCausalLM(StandaloneStep):
    """A decoder-only LM; subclasses build ``self.model`` in ``build_model``.

    Parameter names follow HF's except where the class maps them (the class attributes).
    """

    # HF module name -> (our fused module, shard index within it)
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # HF per-expert module name (``...experts.<e>.<name>.weight``) -> (our stacked
    # [num_experts, ...] parameter, shard index, -1 = whole)
    expert_modules: ClassVar[dict[str, tuple[str, int]]] = {}
    # Substrings of HF names renamed before any mapping (old checkpoint layouts)
    renamed_modules: ClassVar[dict[str, str]] = {}

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        self.model = self.build_model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotaries = {
            GLOBAL_ROPE: RotaryEmbedding(config.rope_theta, config.rotary_dim, config.rope_scaling)
        }
        if config.local_rope_theta is not None:
            local = RotaryEmbedding(config.local_rope_theta, config.rotary_dim, RopeScaling())
            self.rotaries[LOCAL_ROPE] = local
        self.windows = sorted({w for w in config.layer_windows if w is not None})
        self.tie_weights()

    def build_model(self, config: ModelConfig) -> DecoderModel:
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so; call again after
        moving off the meta device, which gives each module its own tensor."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def shard_sizes(self, param_name: str) -> list[int]:
        """Rows each HF shard occupies in a fused weight (per expert for stacked ones)."""
        c = self.config
        parts = param_name.split(".")
        module = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
        if module == "qkv_proj":
            kv = c.num_kv_heads * c.head_dim
            return [c.num_heads * c.head_dim, kv, kv]
        if module == "gate_up_proj":
            is_expert = ".experts." in param_name and c.moe is not None
            size = c.moe.intermediate_size if is_expert and c.moe else c.intermediate_size
            return [size, size]
        raise KeyError(param_name)

    def hidden_states(
        self, batch: ForwardBatch, meta: AttentionMetadata, kv_pool: KVPool
    ) -> torch.Tensor:
        """Final-norm hidden states [num_tokens, hidden] of every new token of ``batch``.

        ``meta`` is ``self.attn_backend.plan(batch)``; windowed layers get their own plans
        here. Writes each layer's new K/V to ``kv_pool`` at ``batch.out_cache_loc`` only.
        """
        dtype = self.model.norm.weight.dtype  # the embedding may be int8 (quantization.py)
        metas: dict[int | None, AttentionMetadata] = {None: meta}
        for window in self.windows:
            metas[window] = self.attn_backend.plan(batch, window=window)
        rope = {name: rotary(batch, dtype) for name, rotary in self.rotaries.items()}
        ctx = StepContext(self.attn_backend, metas, kv_pool, rope)  # type: ignore[arg-type]
        return self.model(batch.input_ids, ctx)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the given hidden rows, in the model's dtype: the sampler
        converts only what needs float32 (a greedy or temperature-only batch does not)."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits  # type: ignore[no-any-return]
