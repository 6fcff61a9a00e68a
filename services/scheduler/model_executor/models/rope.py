"""RoPE parameters as HF configs state them, and the inverse frequencies they give.

HF writes RoPE settings in two layouts (legacy ``rope_theta`` + ``rope_scaling``, or
transformers-5 ``rope_parameters``), and Gemma 3 keeps one set per layer type. This module
reads one such dict into a frozen ``RopeScaling`` and computes frequencies exactly as HF's
``modeling_rope_utils`` does, so cos/sin tables match bit for bit in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Normalised RoPE parameters; ``rope_type`` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and longrope
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the original
    long_factor: tuple[float, ...] = ()  # longrope: past original_max_position_embeddings
    attention_factor: float = 1.0  # longrope: cos/sin multiplier

    @property
    def has_long_factors(self) -> bool:
        return self.rope_type == "longrope"


def parse_rope_scaling(params: dict[str, Any], raw: dict[str, Any]) -> RopeScaling:
    """``params`` is one RoPE dict; ``raw`` the whole config.json (fallback values)."""
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type in ("su", "yarn") and "long_factor" in params:
        rope_type = "longrope"  # Phi-3's old names for the same scheme
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "linear":
        return RopeScaling("linear", factor=float(params["factor"]))
    original = int(
        params.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or raw["max_position_embeddings"]
    )
    if rope_type == "longrope":
        return _longrope(params, raw, original)
    return RopeScaling(
        "llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=original,
    )


def _longrope(params: dict[str, Any], raw: dict[str, Any], original: int) -> RopeScaling:
    factor = params.get("factor")
    if factor is None:  # Phi-3 states the ratio through the two lengths
        factor = int(raw["max_position_embeddings"]) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeScaling(
        "longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        attention_factor=float(attention_factor),
    )


def inv_freq(
    theta: float, rotary_dim: int, scaling: RopeScaling, *, long: bool = False
) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in float32, as HF computes them; ``long``
    picks longrope's long factors."""
    # Explicitly on CPU so a model built under a meta-device context still gets values.
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu")
    exponents = steps.float() / rotary_dim
    if scaling.rope_type == "longrope":
        factors = scaling.long_factor if long else scaling.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * theta**exponents)
    base = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        return base / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(base, scaling)
    return base


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
