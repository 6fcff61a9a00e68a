"""Which native module serves an architecture, and the one-line refusal for a checkpoint
no native path can run, given before any kernel is built or weight read (``model_impl.py``
asks it first, and offers the transformers path where it refuses)."""

from __future__ import annotations

from pathlib import Path

from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.config import (
    HEADLESS_ARCHITECTURES,
    ModelConfig,
    architecture_of,
    read_config_files,
)
from services.scheduler.model_executor.models.gemma3 import Gemma3ForCausalLM
from services.scheduler.model_executor.models.layers import ACTIVATIONS
from services.scheduler.model_executor.models.llama import LlamaForCausalLM
from services.scheduler.model_executor.models.mixtral import MixtralForCausalLM
from services.scheduler.model_executor.models.phi3 import Phi3ForCausalLM
from services.scheduler.model_executor.models.qwen3 import Qwen3ForCausalLM
from services.scheduler.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

NATIVE_MODELS: dict[str, type[NativeCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}
FALLBACK_HINT = "--model-impl transformers"


class UnsupportedModelError(ValueError):
    """A checkpoint no native path can run; the message is one line for the operator."""


def native_model_class(architecture: str) -> type | None:
    """The native module for an HF architecture name (a headless one's is its causal LM's),
    or None when there is none."""
    return NATIVE_MODELS.get(HEADLESS_ARCHITECTURES.get(architecture, architecture))


def check_native_support(model_dir: str | Path) -> ModelConfig:
    """The checkpoint's config, or UnsupportedModelError saying what the native paths lack
    and what would serve it. Reads config files only: cheap enough to run first."""
    raw, generation = read_config_files(model_dir)
    name = Path(model_dir).name
    try:
        architecture = architecture_of(raw)
    except ValueError as exc:
        raise UnsupportedModelError(f"model {name}: {exc}") from None
    if native_model_class(architecture) is None:
        supported = ", ".join(sorted(NATIVE_MODELS))
        raise UnsupportedModelError(
            f"model {name}: no native path for architecture {architecture} (native: "
            f"{supported}); {FALLBACK_HINT} may serve it"
        )
    try:
        config = ModelConfig.from_dict(raw, generation)
        _check_features(config)
    except (KeyError, ValueError) as exc:
        raise UnsupportedModelError(
            f"model {name} ({architecture}): the native path cannot run it: {_describe(exc)}; "
            f"{FALLBACK_HINT} may serve it"
        ) from None
    return config


def _check_features(config: ModelConfig) -> None:
    """Config features no native module computes, refused rather than served wrong."""
    if config.hidden_act not in ACTIVATIONS:
        raise ValueError(
            f"unsupported activation {config.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}"
        )
    if config.attn_logit_softcapping is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if config.rotary_dim % 2 or config.rotary_dim > config.head_dim:
        raise ValueError(f"rotary dimension {config.rotary_dim} does not fit head_dim")


def _describe(exc: Exception) -> str:
    return f"config.json lacks {exc}" if isinstance(exc, KeyError) else str(exc)
