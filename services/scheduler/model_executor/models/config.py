"""What the model runtime needs from an HF checkpoint's config.json, read once.

HF configs come in several generations (``torch_dtype`` vs ``dtype``; legacy
``rope_theta``/``rope_scaling`` vs transformers-5 ``rope_parameters``; Gemma 3's per-layer
RoPE and window pattern; ``num_experts`` vs ``num_local_experts``). This module normalises
them into one frozen dataclass so the model code never looks at raw JSON, and refuses what
the runtime cannot compute correctly instead of silently diverging. Which architecture a
checkpoint names, and whether a native path serves it, is ``registry.py``'s question.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.eos import eos_id_union
from services.scheduler.model_executor.models.dtype import DTYPES
from services.scheduler.model_executor.models.rope import RopeScaling, inv_freq, parse_rope_scaling

SLIDING, FULL = "sliding_attention", "full_attention"
# Router normalisation when config.json does not say: Mixtral always renormalises its
# top-k probabilities; Qwen3-MoE's config class defaults norm_topk_prob to False.
_NORM_TOPK_DEFAULT = {"MixtralForCausalLM": True}
_LOCAL_ROPE_THETA_DEFAULT = {"Gemma3ForCausalLM": 10000.0}


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP: ``top_k`` of ``num_experts`` experts per token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool  # renormalise the chosen experts' probabilities to sum to 1
    sparse_layers: frozenset[int]  # layers with experts; the others have a dense MLP


# Checkpoints of a model's body alone, as embedding models ship (e5-mistral's MistralModel,
# gte-Qwen2's Qwen2Model): no LM head, weight names without the ``model.`` prefix. Each runs
# on its causal LM's native module, under ``--runner pooling`` only.
HEADLESS_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # the causal LM module's name, also for a headless checkpoint
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2 always; Llama when attention_bias is set)
    o_proj_bias: bool  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool
    max_position_embeddings: int
    sliding_window: int | None  # None = full attention
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype  # checkpoint dtype, what "auto" resolves to
    layer_windows: tuple[int | None, ...] = ()  # per layer: attention window, None = full
    rotary_dim: int = 0  # leading dims of each head that RoPE rotates (partial rotary)
    local_rope_theta: float | None = None  # RoPE base of sliding layers, where it differs
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) (Gemma)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    moe: MoeConfig | None = None
    headless: bool = False  # no LM head in the checkpoint (HEADLESS_ARCHITECTURES)

    @property
    def max_context_len(self) -> int:
        """Longest sequence the runtime computes like the reference model: windowed layers
        really attend within their window, so only the position table bounds it."""
        return self.max_position_embeddings

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies [rotary_dim // 2] of the global layers, float32, as HF."""
        return inv_freq(self.rope_theta, self.rotary_dim, self.rope_scaling)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` for EOS ids) in ``model_dir``."""
        raw, generation = read_config_files(model_dir)
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from parsed config.json (and generation_config.json) contents."""
        named = architecture_of(raw)
        architecture = HEADLESS_ARCHITECTURES.get(named, named)
        headless = named in HEADLESS_ARCHITECTURES
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        num_layers = int(raw["num_hidden_layers"])
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = is_qwen2 or bool(raw.get("attention_bias", False))
        sliding_window = _sliding_window(raw, architecture)
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(_global_rope_params(raw), raw, 10000.0),
            rope_scaling=parse_rope_scaling(_global_rope_params(raw), raw),
            vocab_size=int(raw["vocab_size"]),
            # A headless checkpoint's LM head never runs (pooling only): tied, it needs no
            # weights of its own.
            tie_word_embeddings=headless or bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            sliding_window=sliding_window,
            eos_token_ids=eos_id_union(
                raw.get("eos_token_id"), (generation or {}).get("eos_token_id")
            ),
            dtype=_dtype(raw),
            layer_windows=_layer_windows(raw, num_layers, sliding_window),
            rotary_dim=int(head_dim * _partial_rotary_factor(raw)),
            local_rope_theta=_local_rope_theta(raw, architecture),
            hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
            query_pre_attn_scalar=_optional_float(raw, "query_pre_attn_scalar"),
            attn_logit_softcapping=_optional_float(raw, "attn_logit_softcapping"),
            final_logit_softcapping=_optional_float(raw, "final_logit_softcapping"),
            moe=_moe(raw, architecture, num_layers),
            headless=headless,
        )


def read_config_files(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json and generation_config.json (empty when absent) of ``model_dir``."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    raw = json.loads(config_path.read_text(encoding="utf-8"))
    generation_path = model_dir / "generation_config.json"
    if not generation_path.is_file():
        return raw, {}
    return raw, json.loads(generation_path.read_text(encoding="utf-8"))


def architecture_of(raw: dict[str, Any]) -> str:
    """The first architecture config.json names; ValueError when it names none."""
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError("config.json names no architecture (an 'architectures' list)")
    return str(architectures[0])


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict in either layout: transformers-5 ``rope_parameters`` or ``rope_scaling``."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope parameters must be a JSON object, got {params!r}")
    return params


def _global_rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict of full-attention layers (Gemma 3 keeps one per layer type)."""
    params = _rope_params(raw)
    return dict(params.get(FULL) or {}) if FULL in params else params


def _rope_theta(params: dict[str, Any], raw: dict[str, Any], default: float) -> float:
    return float(params.get("rope_theta") or raw.get("rope_theta") or default)


def _local_rope_theta(raw: dict[str, Any], architecture: str) -> float | None:
    """The sliding layers' RoPE base: Gemma 3's per-type dict or legacy rope_local_base_freq
    (whose Gemma 3 default is 10,000)."""
    params = _rope_params(raw)
    if SLIDING in params:
        local = params[SLIDING]
        if (local.get("rope_type") or "default") != "default":
            raise ValueError(f"unsupported rope type {local.get('rope_type')!r} on sliding layers")
        return float(local["rope_theta"])
    value = raw.get("rope_local_base_freq", _LOCAL_ROPE_THETA_DEFAULT.get(architecture))
    return float(value) if value is not None else None


def _partial_rotary_factor(raw: dict[str, Any]) -> float:
    params = _rope_params(raw)
    return float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0)


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    # Qwen configs carry a sliding_window value that only applies with use_sliding_window.
    if not raw.get("use_sliding_window", not architecture.startswith("Qwen")):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _layer_windows(
    raw: dict[str, Any], num_layers: int, window: int | None
) -> tuple[int | None, ...]:
    """Each layer's window: ``layer_types`` where the config lists them, else Gemma's
    ``sliding_window_pattern`` (every pattern-th layer global), else one window for all."""
    types = raw.get("layer_types")
    if window is None:
        return (None,) * num_layers
    if types is None:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
        if pattern:
            types = [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(num_layers)]
    if types is None:
        return (window,) * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
    return tuple(window if t == SLIDING else None for t in types)


def _moe(raw: dict[str, Any], architecture: str, num_layers: int) -> MoeConfig | None:
    num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    if num_experts == 0:
        return None
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    return MoeConfig(
        num_experts=num_experts,
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", _NORM_TOPK_DEFAULT.get(architecture, False))),
        sparse_layers=frozenset(
            i for i in range(num_layers) if i not in dense and (i + 1) % step == 0
        ),
    )


def _optional_float(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    return float(value) if value is not None else None


def _dtype(raw: dict[str, Any]) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {name!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]
