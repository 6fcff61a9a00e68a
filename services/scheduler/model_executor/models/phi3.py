"""Phi-3 and Phi-4-mini: Llama's layout with q/k/v and gate/up already fused in the
checkpoint, partial rotary (``partial_rotary_factor``) and LongRoPE scaling; the last two
live in the config and the shared rotary table, so only the weight names differ here."""

from __future__ import annotations

from typing import ClassVar

from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.layers import DecoderModel, create_pre_norm_decoder


class Phi3ForCausalLM(NativeCausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {}  # stored fused already

    def build_model(self, config: ModelConfig) -> DecoderModel:
        return create_pre_norm_decoder(config)
