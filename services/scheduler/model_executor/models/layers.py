"""The layers every native architecture is built from, over a flat ForwardBatch and a KVPool.

Every step runs on one flat list of new tokens from many requests (prefill chunks and
decode tokens alike); positions come from the batch, K/V go to the pool, and the
attention backend decides how each request sees its context. Numerics follow HF
transformers so greedy generation matches it token for token. q/k/v and gate/up are fused
into single matmuls; the loader fills the fused weights from HF's separate ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.linear import Linear
from services.scheduler.model_executor.models.rope import RopeScaling, inv_freq

GLOBAL_ROPE, LOCAL_ROPE = "global", "local"
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(slots=True)
class StepContext:
    """What every layer of one forward step shares."""

    backend: AttentionBackend
    metas: dict[int | None, AttentionMetadata]  # per attention window (None = full)
    kv_pool: KVPool
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # GLOBAL_ROPE/LOCAL_ROPE -> cos, sin


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, scale by ``weight`` in the model dtype; in one
    pass over each row through ``torch.ops.tokenline.rms_norm`` once ``use_row_kernels``
    has switched it on (``csrc/fused_rows.cpp``: the same roundings)."""

    kernel: bool = False

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and x.stride(-1) == 1:
            # Per-head q/k norms get [tokens, heads, head_dim] views of the fused projection:
            # their rows are gathered (one copy) rather than normalised in eight eager ops.
            rows = x.reshape(-1, x.shape[-1])
            out: torch.Tensor = torch.ops.tokenline.rms_norm(rows, self.weight, self.eps)
            return out.view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores ``weight - 1``, and the scaling happens in
    float32 before the cast back (the reverse of Llama's order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class RotaryEmbedding:
    """cos/sin rows for a step's positions, gathered from tables of every position so far.

    The tables hold what computing the rows per step would (float32 angles, cos and sin,
    the attention factor, then the model dtype), so a row depends on its position alone;
    they double whenever a step reaches past them, so there is no length cap. A decode
    step gathers two rows per token instead of running the half-dozen elementwise ops
    that building them took. LongRoPE picks its long factors once a sequence passes the
    original context, the way HF decides it (see ``_is_long``).
    """

    def __init__(self, theta: float, rotary_dim: int, scaling: RopeScaling) -> None:
        # Plain tensors, not buffers: the loader builds modules on the meta device and
        # fills only checkpoint weights, which would leave a buffer uninitialised.
        self._short = inv_freq(theta, rotary_dim, scaling)
        self._long = inv_freq(theta, rotary_dim, scaling, long=True)
        self._scaling = scaling
        # (device, dtype) -> cos and sin [positions, rotary_dim], short factors then long.
        self._tables: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}

    def __call__(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        positions = batch.positions
        # Every position is below its request's seq_len: the host list says how far the
        # tables must reach without reading the device tensor.
        reach = max(batch.seq_lens, default=0)
        tables = self._tables_reaching(reach, positions.device, dtype)
        cos, sin = (table.index_select(0, positions) for table in tables[:2])
        if self._scaling.has_long_factors:
            is_long = self._is_long(batch)[:, None]
            cos = torch.where(is_long, tables[2].index_select(0, positions), cos)
            sin = torch.where(is_long, tables[3].index_select(0, positions), sin)
        return cos, sin

    def _tables_reaching(
        self, reach: int, device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """This device and dtype's tables, rebuilt twice as long (at least ``reach``
        positions) when the current ones stop short."""
        tables = self._tables.get((device, dtype))
        if tables is not None and tables[0].shape[0] >= reach:
            return tables
        size = max(reach, 2 * tables[0].shape[0] if tables is not None else 1024)
        positions = torch.arange(size, device=device).float()[:, None]
        scale = self._scaling.attention_factor
        tables = []
        factors = [self._short, self._long] if self._scaling.has_long_factors else [self._short]
        for factor in factors:
            freqs = positions * factor.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
            tables += [cos.to(dtype), sin.to(dtype)]
        self._tables[(device, dtype)] = tables
        return tables

    def _is_long(self, batch: ForwardBatch) -> torch.Tensor:
        """[T] bool: long factors for the token. HF decides per forward call by its last
        position: a prompt's tokens all by the prompt's length, a decoded token by its own
        position. With prompt lengths known, that is per token and no chunking of the
        prefill changes it; without them, per request and step. A sequence that crosses
        the original context while generating is prefilled again by the scheduler, with
        the crossing length as its prompt length (``Scheduler._recompute_long``), as HF's
        generate recomputes its cache there."""
        device = batch.positions.device
        lengths = batch.prompt_lens if batch.prompt_lens is not None else batch.seq_lens
        per_req = torch.tensor(lengths, device=device)
        extend_lens = torch.tensor(batch.extend_lens, device=device)
        reach = torch.maximum(torch.repeat_interleave(per_req, extend_lens), batch.positions + 1)
        return reach > self._scaling.original_max_position_embeddings


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of [T, heads, D] by per-token cos/sin
    (HF's rotate_half convention); the rest pass through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


class Attention(nn.Module):
    """Self-attention with fused qkv, optional per-head q/k norms (applied before RoPE),
    an attention window and a choice of RoPE table (Gemma's sliding layers differ). RoPE
    runs in one pass per tensor (``torch.ops.tokenline.rotary``) once ``use_row_kernels``
    has switched it on."""

    kernel: bool = False

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        qk_norm: type[RMSNorm] | None = None,
        rope: str = GLOBAL_ROPE,
    ) -> None:
        super().__init__()
        self.layer_id, self.rope = layer_id, rope
        self.window = config.layer_windows[layer_id] if config.layer_windows else None
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim, self.scale = config.head_dim, config.attn_scale
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps)
        self.has_qk_norm = qk_norm is not None

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = ctx.rope[self.rope]
        if self.kernel:
            q, k = torch.ops.tokenline.rotary(q, cos, sin), torch.ops.tokenline.rotary(k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = ctx.backend.forward(
            q,
            k,
            v,
            layer=self.layer_id,
            meta=ctx.metas[self.window],
            kv_pool=ctx.kv_pool,
            scale=self.scale,
        )
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up fused; SiLU-and-multiply
    in one pass (``torch.ops.tokenline.silu_and_mul``) once ``use_row_kernels`` has switched
    it on."""

    kernel: bool = False

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.is_silu = config.hidden_act == "silu"
        self.act = ACTIVATIONS[config.hidden_act]
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = gated(self.gate_up_proj(x), self.act, self.intermediate_size, self.kernel)
        return self.down_proj(hidden)


def gated(
    gate_up: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    intermediate_size: int,
    kernel: bool,
) -> torch.Tensor:
    """``act(gate) * up`` of a fused gate/up projection's output [rows, 2 * I]; through the
    compiled SiLU-and-multiply when ``kernel`` (a SiLU module switched on by
    ``use_row_kernels``). Dense MLPs and MoE experts share it."""
    if kernel:
        return torch.ops.tokenline.silu_and_mul(gate_up)  # type: ignore[no-any-return]
    gate, up = gate_up.split(intermediate_size, dim=-1)
    return act(gate) * up


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the MLP (dense or experts)."""

    def __init__(self, config: ModelConfig, self_attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, the layers, the final norm; ``embed_scale`` multiplies the embedding in
    the model dtype (Gemma's sqrt(hidden))."""

    def __init__(
        self,
        config: ModelConfig,
        layers: list[nn.Module],
        norm: RMSNorm,
        embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        # Built from an empty tensor: the default random init (``normal_``) imports torch's
        # compiler stack on first call, seconds of CPU for weights the checkpoint replaces.
        empty = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale).to(x.dtype)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


def dense_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
    return MLP(config)


def create_pre_norm_decoder(
    config: ModelConfig,
    qk_norm: type[RMSNorm] | None = None,
    mlp: Callable[[ModelConfig, int], nn.Module] = dense_mlp,
) -> DecoderModel:
    """The Llama-shaped stack most architectures are: pre-norm layers of attention (with
    ``qk_norm`` on q and k, if given) and ``mlp(config, layer_id)``, then a final norm."""
    layers: list[nn.Module] = [
        DecoderLayer(config, Attention(config, i, qk_norm=qk_norm), mlp(config, i))
        for i in range(config.num_layers)
    ]
    return DecoderModel(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps))
