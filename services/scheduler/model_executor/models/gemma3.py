"""Gemma 3 (text): sandwich norms around attention and the MLP, RMSNorm with a +1 weight,
an embedding scaled by sqrt(hidden), q/k norms, ``query_pre_attn_scalar`` for the attention
scale, and interleaved sliding-window and global layers, each kind with its own RoPE base
(the global layers' with the config's scaling)."""

from __future__ import annotations

import torch
from torch import nn

from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.layers import (
    GLOBAL_ROPE,
    LOCAL_ROPE,
    MLP,
    Attention,
    DecoderModel,
    GemmaRMSNorm,
    StepContext,
)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        is_sliding = config.layer_windows[layer_id] is not None
        rope = LOCAL_ROPE if is_sliding and config.local_rope_theta is not None else GLOBAL_ROPE
        self.self_attn = Attention(config, layer_id, qk_norm=GemmaRMSNorm, rope=rope)
        self.mlp = MLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(NativeCausalLM):
    def build_model(self, config: ModelConfig) -> DecoderModel:
        layers: list[nn.Module] = [Gemma3DecoderLayer(config, i) for i in range(config.num_layers)]
        norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        return DecoderModel(config, layers, norm, embed_scale=config.hidden_size**0.5)
