"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse expert MLPs on the layers that
``decoder_sparse_step`` and ``mlp_only_layers`` pick; the router renormalises its top-k
probabilities only when ``norm_topk_prob`` says so."""

from __future__ import annotations

from typing import ClassVar

from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.layers import (
    DecoderModel,
    RMSNorm,
    create_pre_norm_decoder,
)
from services.scheduler.model_executor.models.moe import create_mlp


class Qwen3MoeForCausalLM(NativeCausalLM):
    expert_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", -1),
    }

    def build_model(self, config: ModelConfig) -> DecoderModel:
        return create_pre_norm_decoder(config, qk_norm=RMSNorm, mlp=create_mlp)
