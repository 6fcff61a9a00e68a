"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat ForwardBatch and a KVPool.

Every step runs on one flat list of new tokens from many requests (prefill chunks
and decode tokens alike); positions come from the batch, K/V go to the pool, and
the attention backend decides how each request sees its context. Numerics follow
HF transformers' implementation so greedy generation matches it token for token.
q/k/v and gate/up are fused into single matmuls; the loader splits HF weights in.

Owns the network: its weights, the rotary tables and the attention backend its layers
call (chosen at load). It does not decide which rows become logits or build a step's
tensors: ``ModelRunner`` does, through ``hidden_states`` and ``compute_logits``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.linear import Linear


@dataclass(slots=True)
class StepContext:
    """What every layer of one forward step shares."""

    backend: AttentionBackend
    meta: AttentionMetadata
    kv_pool: KVPool
    cos: torch.Tensor  # [T, head_dim], model dtype
    sin: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype: the order HF uses.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding:
    """cos/sin tables for absolute positions, computed per step (cheap, no length cap)."""

    def __init__(self, config: ModelConfig) -> None:
        # A plain tensor, not a buffer: the loader builds modules on the meta device and
        # fills only checkpoint weights, which would leave a buffer uninitialised.
        self._inv_freq = config.inv_freq()

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by per-token cos/sin [T, D] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), ctx.cos, ctx.sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), ctx.cos, ctx.sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = ctx.backend.forward(
            q, k, v, layer=self.layer_id, meta=ctx.meta, kv_pool=ctx.kv_pool, scale=self.scale
        )
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The whole model; parameter names follow HF except the fused qkv/gate_up projections."""

    # HF checkpoint name -> (our fused parameter, shard index within it)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so; call again after
        moving off the meta device, which gives each module its own tensor."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def shard_sizes(self, fused: str) -> list[int]:
        """Rows each HF shard occupies in a fused weight, in shard-index order."""
        c = self.config
        if fused == "qkv_proj":
            kv = c.num_kv_heads * c.head_dim
            return [c.num_heads * c.head_dim, kv, kv]
        if fused == "gate_up_proj":
            return [c.intermediate_size, c.intermediate_size]
        raise KeyError(fused)

    def hidden_states(
        self, batch: ForwardBatch, meta: AttentionMetadata, kv_pool: KVPool
    ) -> torch.Tensor:
        """Final-norm hidden states [num_tokens, hidden] of every new token of ``batch``.

        ``meta`` is ``self.attn_backend.plan(batch)``. Writes each layer's new K/V to
        ``kv_pool`` at ``batch.out_cache_loc`` and nothing else.
        """
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin = self.rotary(batch.positions, dtype)
        ctx = StepContext(self.attn_backend, meta, kv_pool, cos, sin)
        return self.model(batch.input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the given hidden rows, in the model's dtype: the sampler
        converts only what needs float32 (a greedy or temperature-only batch does not)."""
        return self.lm_head(hidden)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_pool: KVPool, *, all_logits: bool = False
    ) -> torch.Tensor:
        """One standalone step, for tests and tools (serving goes through ``ModelRunner``,
        which plans the batch itself and runs the LM head only on the rows it samples).

        Returns float32 logits [num_reqs, vocab] for each request's last new token, or
        [num_tokens, vocab] for every new token when ``all_logits``.
        """
        hidden = self.hidden_states(batch, self.attn_backend.plan(batch), kv_pool)
        if not all_logits:
            last_rows = torch.tensor(batch.extend_lens, dtype=torch.int64, device=hidden.device)
            hidden = hidden[last_rows.cumsum(0) - 1]
        return self.compute_logits(hidden).float()
