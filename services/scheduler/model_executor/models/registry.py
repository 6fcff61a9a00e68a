"""Which architectures tokenline computes with its own model code (the native path).

Anything else may still run through transformers (``transformers_model.py``); the
choice between the two is ``model_impl.py``'s.
"""

from __future__ import annotations

from services.scheduler.model_executor.models.llama import LlamaForCausalLM

_NATIVE_MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def native_model_class(architecture: str) -> type | None:
    """tokenline's own class for an HF ``architectures`` entry, or None when it has none."""
    return _NATIVE_MODELS.get(architecture)
