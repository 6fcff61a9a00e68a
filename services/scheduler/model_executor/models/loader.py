"""Load an HF checkpoint directory (config.json + safetensors) into our Llama module.

The module is built on the meta device and materialised straight in the target
dtype and device, so no memory is spent on a random init that is overwritten.
Every checkpoint tensor must land in exactly one parameter slot and every slot
must be filled: a silently half-loaded model would serve plausible garbage.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from services.scheduler.model_executor.attention import create_attention_backend
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.dtype import choose_dtype
from services.scheduler.model_executor.models.linear import prepare_linears
from services.scheduler.model_executor.models.llama import LlamaForCausalLM
from services.scheduler.model_executor.models.model_impl import resolve_model_impl
from services.scheduler.model_executor.models.transformers_model import (
    TransformersCausalLM,
    load_transformers_model,
)

logger = logging.getLogger(__name__)

# Buffers some older checkpoints saved; we recompute them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    attention_backend: str = "torch",
    model_impl: str = "auto",
    batch_invariant: bool = False,
) -> tuple[LlamaForCausalLM | TransformersCausalLM, ModelConfig]:
    """Build the model for ``model_dir`` on ``device`` with its weights loaded, in eval mode,
    on the path ``model_impl`` (auto, native, transformers: ``model_impl.py``) picks.

    ``dtype`` None or "auto" is what ``choose_dtype`` picks for the checkpoint on ``device``.
    ``batch_invariant``: each row's result independent of the rest of its batch, at a cost
    (``linear.py``, ``torch_backend.py``).
    """
    model_dir = Path(model_dir)
    device = torch.device(device)
    impl = resolve_model_impl(model_dir, model_impl)
    if impl.path == "transformers":
        if batch_invariant:
            raise ValueError(
                "--batch-invariant needs a native model: transformers' own linear layers do "
                "not run in fixed row tiles"
            )
        chosen = choose_dtype(dtype, impl.dtype, device).dtype
        files = checkpoint_files(model_dir)
        return load_transformers_model(model_dir, files, chosen, device, attention_backend)
    config = ModelConfig.from_dir(model_dir)
    backend = create_attention_backend(attention_backend, device, batch_invariant)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    chosen = choose_dtype(dtype, config.dtype, device).dtype
    model = model.to(dtype=chosen).to_empty(device=device)
    model.tie_weights()
    load_weights(model, checkpoint_files(model_dir))
    linears = prepare_linears(model, device, chosen, batch_invariant)  # packing, row buckets
    logger.info("model %s: %s on %s, linear layers %s", model_dir.name, chosen, device, linears)
    return model.eval(), config


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
def load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its parameter (or fused shard), checking coverage."""
    params = dict(model.named_parameters())  # a tied lm_head appears only as embed_tokens
    loaded: dict[str, set[int]] = defaultdict(set)
    unexpected: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                target = _target(model, name)
                if target is None:
                    continue
                param_name, shard = target
                if param_name not in params:
                    unexpected.append(name)
                    continue
                dest = _shard_view(model, params[param_name], param_name, shard)
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(
                        f"{path.name}: {name} has shape {tuple(tensor.shape)}, "
                        f"model expects {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded[param_name].add(shard)
    if unexpected:
        raise ValueError(f"checkpoint has weights the model does not: {sorted(unexpected)[:10]}")
    missing = [n for n in params if loaded[n] != _expected_shards(model, n)]
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:10]}")


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, int] | None:
    """Our parameter name and shard index (-1 = whole tensor) for a checkpoint name."""
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return None  # some tied checkpoints store a copy; the embedding is the source
    parts = name.split(".")
    for hf_name, (fused, shard) in model.packed_modules.items():
        if hf_name in parts:
            return ".".join(fused if p == hf_name else p for p in parts), shard
    return name, -1


def _shard_view(
    model: LlamaForCausalLM, param: torch.Tensor, param_name: str, shard: int
) -> torch.Tensor:
    if shard < 0:
        return param
    sizes = model.shard_sizes(param_name.split(".")[-2])
    return param.narrow(0, sum(sizes[:shard]), sizes[shard])


def _expected_shards(model: LlamaForCausalLM, param_name: str) -> set[int]:
    module = param_name.split(".")[-2]
    fused = {fused for fused, _ in model.packed_modules.values()}
    return set(range(len(model.shard_sizes(module)))) if module in fused else {-1}
