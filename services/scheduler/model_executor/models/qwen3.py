"""Qwen3: Llama's layout with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.layers import (
    DecoderModel,
    RMSNorm,
    create_pre_norm_decoder,
)


class Qwen3ForCausalLM(NativeCausalLM):
    def build_model(self, config: ModelConfig) -> DecoderModel:
        return create_pre_norm_decoder(config, qk_norm=RMSNorm)
