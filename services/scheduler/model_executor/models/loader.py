"""Load an HF checkpoint directory (config.json + safetensors) into its native module.

The module is built on the meta device and materialised straight in the target
dtype and device, so no memory is spent on a random init that is overwritten.
Every checkpoint tensor must land in exactly one parameter slot and every slot
must be filled: a silently half-loaded model would serve plausible garbage. Which
slot a checkpoint name goes to is the model class's business (its packed, expert and
renamed module maps); this module knows no architecture.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from services.scheduler.model_executor.attention import create_attention_backend
from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.dtype import choose_dtype
from services.scheduler.model_executor.models.linear import prepare_linears
from services.scheduler.model_executor.models.model_impl import resolve_model_impl
from services.scheduler.model_executor.models.quantization import (
    apply_quantization,
    check_quantization,
)
from services.scheduler.model_executor.models.registry import NATIVE_MODELS, check_native_support

if TYPE_CHECKING:
    from services.scheduler.model_executor.models.transformers_model import TransformersCausalLM

logger = logging.getLogger(__name__)

# Buffers some older checkpoints saved; we recompute them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<module>\w+)\.weight$")
WHOLE = -1  # shard index of a tensor that fills its slot


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, an expert's slice of a stacked one
    (``expert``), and a shard of a fused one (``shard``)."""

    param: str
    expert: int | None = None
    shard: int = WHOLE


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    attention_backend: str = "torch",
    model_impl: str = "auto",
    batch_invariant: bool = False,
    decode_kernel: bool = False,
    quantization: str = "none",
    decode_copy: bool | None = False,
) -> tuple[NativeCausalLM | TransformersCausalLM, ModelConfig]:
    """Build the model for ``model_dir`` on ``device`` with its weights loaded, in eval mode,
    on the path ``model_impl`` (auto, native, transformers: ``model_impl.py``) picks.

    ``dtype`` None or "auto" is what ``choose_dtype`` picks for the checkpoint on ``device``.
    ``batch_invariant``: each row's result independent of the rest of its batch, at a cost
    (``linear.py``, ``torch_backend.py``). ``decode_kernel``: the compiled CPU decode
    attention kernel is loaded, for the backend to call (``torch_backend.py``).
    ``quantization`` "int8": weight-only int8; "w8a8": int8 activations too
    (``quantization.py``). ``decode_copy``: bf16
    linear layers also keep their weight in the decode kernel's layout (``linear.py``; None:
    where it fits a share of the memory). Raises
    ``UnsupportedModelError`` (one line) for a checkpoint the chosen path cannot run,
    ``QuantizationError`` (one line) for a quantization it cannot.
    """
    model_dir = Path(model_dir)
    device = torch.device(device)
    impl = resolve_model_impl(model_dir, model_impl)
    check_quantization(quantization, device, impl.path)
    if impl.path == "transformers":
        if batch_invariant:
            raise ValueError(
                "--batch-invariant needs a native model: transformers' own linear layers do "
                "not run in fixed row tiles"
            )
        chosen = choose_dtype(dtype, impl.dtype, device).dtype
        checkpoint_files(model_dir)  # refuses a folder without safetensors in one line
        if decode_copy:
            logger.warning("--decode-copy: off, the transformers path runs transformers' layers")
        # Imported on use: transformers' modeling stack costs seconds of CPU to import and
        # a natively served model never touches it.
        from services.scheduler.model_executor.models.transformers_model import (
            load_transformers_model,
        )

        return load_transformers_model(model_dir, chosen, device, attention_backend, decode_kernel)
    model, config = load_native(
        model_dir, dtype, device, attention_backend, batch_invariant, decode_kernel
    )
    chosen = model.model.norm.weight.dtype
    if quantization != "none":
        for line in apply_quantization(model, quantization, batch_invariant):
            logger.info("model %s: %s", model_dir.name, line)
    linears = prepare_linears(model, device, chosen, batch_invariant, decode_copy)
    logger.info(
        "model %s (%s): %s on %s, linear layers %s",
        model_dir.name,
        config.architecture,
        chosen,
        device,
        linears,
    )
    return model.eval(), config


def load_native(
    model_dir: Path,
    dtype: torch.dtype | str | None,
    device: torch.device,
    attention_backend: str = "torch",
    batch_invariant: bool = False,
    decode_kernel: bool = False,
) -> tuple[NativeCausalLM, ModelConfig]:
    """The native model of ``model_dir`` with its checkpoint weights, dense and not yet
    quantized or packed: ``load_model``'s first half (a benchmark may alter it between)."""
    config = check_native_support(model_dir)
    backend = create_attention_backend(attention_backend, device, batch_invariant, decode_kernel)
    with torch.device("meta"):
        model = NATIVE_MODELS[config.architecture](config, backend)
    chosen = choose_dtype(dtype, config.dtype, device).dtype
    model = model.to(dtype=chosen).to_empty(device=device)
    model.tie_weights()
    load_weights(model, checkpoint_files(model_dir))
    return model, config


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: sharded (with index) or a single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir} (.bin is not supported)")
    return files


@torch.no_grad()
def load_weights(model: NativeCausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its parameter slot, checking full coverage."""
    params = dict(model.named_parameters())  # a tied lm_head appears only as embed_tokens
    loaded: dict[str, set[tuple[int | None, int]]] = defaultdict(set)
    unexpected: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                target = weight_target(model, name)
                if target is None:
                    continue
                if target.param not in params:
                    unexpected.append(name)
                    continue
                dest = _slot(model, params[target.param], target)
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(
                        f"{path.name}: {name} has shape {tuple(tensor.shape)}, "
                        f"model expects {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded[target.param].add((target.expert, target.shard))
    if unexpected:
        raise ValueError(f"checkpoint has weights the model does not: {sorted(unexpected)[:10]}")
    missing = [n for n, p in params.items() if not _is_complete(model, n, p, loaded[n])]
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:10]}")


def weight_target(model: NativeCausalLM, name: str) -> WeightTarget | None:
    """Where checkpoint tensor ``name`` goes in ``model``; None for one we recompute."""
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return None  # some tied checkpoints store a copy; the embedding is the source
    if model.config.headless and not name.startswith("model."):
        name = f"model.{name}"  # a headless checkpoint is the causal LM's ``model`` alone
    for old, new in model.renamed_modules.items():
        name = name.replace(old, new)
    expert = _EXPERT_NAME.match(name)
    if expert is not None and expert["module"] in model.expert_modules:
        stacked, shard = model.expert_modules[expert["module"]]
        return WeightTarget(f"{expert['prefix']}.{stacked}", int(expert["expert"]), shard)
    parts = name.split(".")
    for hf_name, (fused, shard) in model.packed_modules.items():
        if hf_name in parts:
            return WeightTarget(".".join(fused if p == hf_name else p for p in parts), None, shard)
    return WeightTarget(name)


def _slot(model: NativeCausalLM, param: torch.Tensor, target: WeightTarget) -> torch.Tensor:
    view = param if target.expert is None else param[target.expert]
    if target.shard == WHOLE:
        return view
    sizes = model.shard_sizes(target.param)
    return view.narrow(0, sum(sizes[: target.shard]), sizes[target.shard])


def _is_complete(
    model: NativeCausalLM, name: str, param: torch.Tensor, loaded: set[tuple[int | None, int]]
) -> bool:
    """Whether ``loaded`` (expert, shard) pairs fill the parameter: whole, or every shard
    (of every expert, for a stacked one)."""
    if (None, WHOLE) in loaded:
        return True
    fused = {f for f, _ in model.packed_modules.values()}
    stacked = {(f, s) for f, s in model.expert_modules.values()}
    module = name.split(".")[-2] if name.endswith((".weight", ".bias")) else name.split(".")[-1]
    is_stacked = ".experts." in f".{name}" and any(module == f for f, _ in stacked)
    shards: set[int] = (
        {s for f, s in stacked if f == module}
        if is_stacked
        else set(range(len(model.shard_sizes(name))))
        if module in fused
        else {WHOLE}
    )
    experts: list[int | None] = list(range(param.shape[0])) if is_stacked else [None]
    return loaded == {(e, s) for e in experts for s in shards}
