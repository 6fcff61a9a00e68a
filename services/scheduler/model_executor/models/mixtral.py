"""Mixtral: Mistral's attention with a sparse expert MLP on every layer; the router
renormalises its top-k probabilities. Checkpoints name the block ``block_sparse_moe`` and
the experts' projections w1 (gate), w3 (up) and w2 (down)."""

from __future__ import annotations

from typing import ClassVar

from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.layers import DecoderModel, create_pre_norm_decoder
from services.scheduler.model_executor.models.moe import create_mlp


class MixtralForCausalLM(NativeCausalLM):
    expert_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", -1),
    }
    renamed_modules: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}

    def build_model(self, config: ModelConfig) -> DecoderModel:
        return create_pre_norm_decoder(config, mlp=create_mlp)
