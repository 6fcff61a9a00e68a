"""Which path serves a checkpoint (``--model-impl``), decided from config.json alone.

``native`` is tokenline's own model code (``registry.py``); ``transformers`` runs the
architecture's transformers module with tokenline's attention plugged in
(``transformers_model.py``). ``auto`` takes native where it exists. A checkpoint that
the chosen path cannot run is refused here, in one line, before any weight is read or
kernel built: invariant 8 of DESIGN.md (proven path, or a one-line refusal).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from services.scheduler.model_executor.models.config import HEADLESS_ARCHITECTURES
from services.scheduler.model_executor.models.dtype import DTYPES
from services.scheduler.model_executor.models.registry import (
    NATIVE_MODELS,
    UnsupportedModelError,
    check_native_support,
    native_model_class,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

ModelImplName = Literal["auto", "native", "transformers"]
ModelPath = Literal["native", "transformers"]
MODEL_IMPLS: tuple[ModelImplName, ...] = ("auto", "native", "transformers")

# Config attributes that change attention in ways tokenline's backends do not compute.
_UNHONOURED_ATTENTION = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "kv_lora_rank": "multi-head latent attention (a compressed KV cache)",
    "attention_chunk_size": "chunked local attention",
    "alibi": "ALiBi position biases",
    "use_alibi": "ALiBi position biases",
}
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True, slots=True)
class ModelImpl:
    """The path chosen for a checkpoint, and what the engine reports about it."""

    architecture: str  # the config.json ``architectures`` entry served
    path: ModelPath
    dtype: torch.dtype  # the checkpoint's dtype, what ``--dtype auto`` starts from
    headless: bool = False  # a model body without an LM head: it can only pool


def resolve_model_impl(model_dir: str | Path, requested: str = "auto") -> ModelImpl:
    """The path that serves ``model_dir`` under ``--model-impl requested``, or
    ``UnsupportedModelError`` saying what is missing and what would serve it."""
    if requested not in MODEL_IMPLS:
        raise UnsupportedModelError(f"unknown --model-impl {requested!r}; choose {MODEL_IMPLS}")
    raw = _read_config(Path(model_dir))
    architectures = list(raw.get("architectures") or [])
    dtype = _checkpoint_dtype(raw)
    native = [a for a in architectures if native_model_class(a) is not None]
    native_refusal = _native_refusal(model_dir) if native else None
    if native and native_refusal is None and requested != "transformers":
        return ModelImpl(native[0], "native", dtype, native[0] in HEADLESS_ARCHITECTURES)
    refusal = transformers_refusal(Path(model_dir), architectures)
    supported = ", ".join(sorted(NATIVE_MODELS))
    if requested == "native":
        serve_by = "use --model-impl transformers" if refusal is None else refusal
        why = f"{native_refusal}; " if native_refusal else ""
        raise UnsupportedModelError(
            f"unsupported architectures {architectures} for --model-impl native "
            f"(native: {supported}); {why}{serve_by}"
        )
    if refusal is not None:
        raise UnsupportedModelError(
            f"unsupported architectures {architectures}: {refusal}; tokenline serves "
            f"{supported} natively and other decoder-only causal LMs through transformers"
        )
    return ModelImpl(architectures[0], "transformers", dtype)


def _native_refusal(model_dir: str | Path) -> str | None:
    """Why the native module of this architecture cannot run this checkpoint (a config
    feature it does not compute), or None when it can."""
    try:
        check_native_support(model_dir)
    except UnsupportedModelError as exc:
        return str(exc)
    return None


def transformers_refusal(model_dir: Path, architectures: list[str]) -> str | None:
    """Why the transformers path cannot run this checkpoint, or None when it can.

    transformers' model registry is imported here, not at module level: it pulls in
    torch's compiler stack (seconds of CPU), which a natively served model never uses."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        hf_config = AutoConfig.from_pretrained(model_dir)  # local files, no remote code
    except (ValueError, KeyError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"transformers {transformers.__version__} cannot read its config ({first})"
    if getattr(hf_config, "is_encoder_decoder", False):
        return "an encoder-decoder model, not decoder-only"
    found = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    model_class = cast("type[PreTrainedModel] | None", found)
    if model_class is None:
        return f"AutoModelForCausalLM has no class for model_type {hf_config.model_type!r}"
    if model_class.__name__ not in architectures:
        return (
            f"not a causal LM checkpoint (AutoModelForCausalLM would build {model_class.__name__})"
        )
    if hf_config.get_text_config() is not hf_config:
        return "a multimodal checkpoint (only text-only causal LMs run through transformers)"
    if not model_class.is_backend_compatible():
        name = model_class.__name__
        return f"{name} does not route attention through transformers' attention interface"
    return _attention_refusal(hf_config)


def _attention_refusal(hf_config: PretrainedConfig) -> str | None:
    """What in the config's attention the hook cannot honour, if anything."""
    for attr, feature in _UNHONOURED_ATTENTION.items():
        if getattr(hf_config, attr, None):
            return f"it needs {feature} ({attr}), which tokenline's attention does not compute"
    kv_heads = getattr(hf_config, "num_key_value_heads", None)
    if kv_heads is not None and not isinstance(kv_heads, int):
        return "its layers have different numbers of KV heads; the KV pool needs one shape"
    other_layers = set(getattr(hf_config, "layer_types", None) or []) - _ATTENTION_LAYER_TYPES
    if other_layers:
        return f"it has layers without attention ({', '.join(sorted(other_layers))})"
    return None


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"no config.json in model directory {model_dir}")
    raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return raw


def _checkpoint_dtype(raw: dict[str, Any]) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise UnsupportedModelError(
            f"unsupported checkpoint dtype {name!r}; supported: {', '.join(DTYPES)}"
        )
    return DTYPES[name]


def main(argv: list[str] | None = None) -> None:
    """``python -m services.scheduler.model_executor.models.model_impl --model DIR
    [--model-impl X]``: the path that would serve DIR, or its one-line refusal (``make
    model`` runs this before it compiles kernels)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-impl", default="auto")
    args = parser.parse_args(argv)
    try:
        impl = resolve_model_impl(args.model, args.model_impl)
    except UnsupportedModelError as exc:
        raise SystemExit(f"{args.model}: {exc}") from None
    print(f"{args.model}: {impl.architecture} served by the {impl.path} path")


if __name__ == "__main__":
    main()
