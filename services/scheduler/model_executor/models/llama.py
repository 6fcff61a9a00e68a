"""Llama, and the architectures that are Llama with other config values: Mistral (a
sliding window on every layer) and Qwen2 (q/k/v biases)."""

from __future__ import annotations

from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.layers import DecoderModel, create_pre_norm_decoder


class LlamaForCausalLM(NativeCausalLM):
    def build_model(self, config: ModelConfig) -> DecoderModel:
        return create_pre_norm_decoder(config)
