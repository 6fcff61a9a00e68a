"""What the model runtime needs from an HF checkpoint's config.json, read once.

HF configs come in several generations (``torch_dtype`` vs ``dtype``; legacy
``rope_theta``/``rope_scaling`` vs transformers-5 ``rope_parameters``). This module
normalises them into one frozen dataclass so the model code never looks at raw JSON,
and refuses what the runtime cannot compute correctly instead of silently diverging.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.eos import eos_id_union
from services.scheduler.model_executor.models.dtype import DTYPES

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Normalised RoPE parameters; ``rope_type`` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
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

    @property
    def max_context_len(self) -> int:
        """Longest sequence the runtime computes exactly like the reference model.

        The runtime has no sliding-window attention; within the window, full attention
        is identical, so the scheduler caps contexts here rather than diverge past it.
        """
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies [head_dim // 2] in float32, as HF computes them."""
        # Explicitly on CPU so a model built under a meta-device context still gets values.
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu")
        exponents = steps.float() / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        scaling = self.rope_scaling
        if scaling.rope_type == "linear":
            return inv_freq / scaling.factor
        if scaling.rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, scaling)
        return inv_freq

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` for EOS ids) in ``model_dir``."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        raw = json.loads(config_path.read_text(encoding="utf-8"))
        generation_path = model_dir / "generation_config.json"
        generation = (
            json.loads(generation_path.read_text(encoding="utf-8"))
            if generation_path.is_file()
            else {}
        )
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from parsed config.json (and generation_config.json) contents."""
        architecture = _architecture(raw)
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = is_qwen2 or bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            vocab_size=int(raw["vocab_size"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            sliding_window=_sliding_window(raw, is_qwen2),
            eos_token_ids=eos_id_union(
                raw.get("eos_token_id"), (generation or {}).get("eos_token_id")
            ),
            dtype=_dtype(raw),
        )


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return str(name)
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    raise ValueError(f"unsupported architectures {architectures}; supported: {supported}")


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict in either layout: transformers-5 ``rope_parameters`` or ``rope_scaling``."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope parameters must be a JSON object, got {params!r}")
    return params


def _rope_theta(raw: dict[str, Any]) -> float:
    return float(_rope_params(raw).get("rope_theta") or raw.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling:
    params = _rope_params(raw)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "linear":
        return RopeScaling("linear", factor=float(params["factor"]))
    return RopeScaling(
        "llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or raw["max_position_embeddings"]
        ),
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, smooth in between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _sliding_window(raw: dict[str, Any], is_qwen2: bool) -> int | None:
    # Qwen2 configs carry a sliding_window value that only applies with use_sliding_window.
    if is_qwen2 and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _dtype(raw: dict[str, Any]) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {name!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]
