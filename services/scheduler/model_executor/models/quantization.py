"""``--quantization``: which weights of a loaded native model become int8, and where the
option is refused.

``int8`` quantizes every linear projection (q/k/v/o, gate/up/down, fused or not), MoE
experts and the LM head, per output channel (``int8_weight.py``); norms, biases and MoE
routers stay as loaded. A tied embedding is then looked up from the LM head's int8 table:
the head's output channels are the vocabulary rows, so the embedding and the head stay one
table, the same numbers, and the dense copy is freed. An untied embedding is left exact
(a lookup reads a few rows, so int8 would save memory but no time).

``w8a8`` quantizes the same weights the same way, packs them for the engine's int8 x int8
kernel and quantizes every matmul's activations too, one scale per row
(``w8a8_weight.py``): prompt chunks and large batches wait on multiplies, which
AVX512-VNNI does twice as many of an instruction in int8 as in bf16. Where that kernel runs
and AMX does not, ``int8`` takes it too, each row of activations in two int8 parts that keep
~15 bits (``int8_takes_vnni_kernel``): the weight-only product, without widening the weight
to bf16. docs/quantization.md has the measurements behind these choices.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.int8.int8_weight import (
    ROWS_KERNEL,
    Int8Weight,
    can_quantize,
    tiles_available,
)
from services.scheduler.model_executor.models.int8.w8a8_weight import (
    QuantizedWeight,
    W8A8Weight,
    w8a8_available,
)
from services.scheduler.model_executor.models.linear import Linear
from services.scheduler.model_executor.models.moe import Experts, SparseMoeBlock
from services.scheduler.ops.cpu_kernels import is_registered
from services.scheduler.ops.isa_levels import machine_level

Quantization = Literal["none", "int8", "w8a8"]
QUANTIZATIONS: tuple[Quantization, ...] = ("none", "int8", "w8a8")
W8A8_LEVEL = "avx512_bf16"  # the kernel build with AVX512-VNNI (ops/isa_levels.py)


class QuantizationError(ValueError):
    """A ``--quantization`` this configuration cannot serve; the message is one line."""


def check_quantization(quantization: str, device: torch.device, model_path: str) -> None:
    """Refuse, in one line and before any weight is read, what int8 cannot serve:
    another device than the CPU (the kernel path is built and tested there only) and the
    transformers model path (its own linear layers are not ours to quantize)."""
    if quantization not in QUANTIZATIONS:
        raise QuantizationError(f"unknown --quantization {quantization!r}; choose {QUANTIZATIONS}")
    if quantization == "none":
        return
    if device.type != "cpu":
        raise QuantizationError(
            f"--quantization {quantization} runs on the CPU only (its int8 matmuls are "
            f"CPU kernels); not on {device.type}"
        )
    if model_path != "native":
        raise QuantizationError(
            f"--quantization {quantization} needs a native model (--model-impl native): "
            "the transformers path runs transformers' own linear layers"
        )
    level = machine_level().name
    if quantization == "w8a8" and level != W8A8_LEVEL:
        raise QuantizationError(
            f"--quantization w8a8 needs AVX512-VNNI and AVX512-BF16 (kernel level "
            f"{W8A8_LEVEL}); this CPU runs {level}: use int8"
        )


def apply_quantization(
    model: NativeCausalLM, quantization: str, batch_invariant: bool = False, lm_head: bool = True
) -> list[str]:
    """Quantize ``model`` in place as ``--quantization`` serves it: int8 weights
    (``quantize_model``; ``lm_head`` as there), then packed for the w8a8 kernel where it
    runs them (every w8a8 model; int8 where ``int8_takes_vnni_kernel``). Returns lines for
    the start-up log."""
    lines = [quantize_model(model, batch_invariant, lm_head)]
    if quantization == "w8a8":
        lines.append(f"w8a8, activations int8 in {quantize_activations(model)} matmuls")
    elif int8_takes_vnni_kernel(model.model.norm.weight.dtype):
        count = pack_int8_weights(model, activation_parts=2)
        lines.append(f"int8 on the VNNI kernel in {count} matmuls, activations in two int8 parts")
    return lines


class QuantizedEmbedding(nn.Module):
    """A tied embedding read from the LM head's int8 table: row ``i`` is
    ``qweight[i] * scales[i]``, the very row the head scores hidden states against."""

    def __init__(self, table: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.rows(input_ids).float() * self.table.scales[input_ids, None]
        return rows.to(self.dtype)


def quantize_model(
    model: NativeCausalLM, batch_invariant: bool = False, lm_head: bool = True
) -> str:
    """Quantize ``model``'s weights to int8 in place, freeing the dense ones (see the
    module docstring); ``lm_head`` False keeps the head (and a tied embedding) exact.
    With ``batch_invariant`` each matmul's rows are independent of their batch
    (``int8_weight.py``). Returns a line for the start-up log."""
    routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoeBlock)}
    kept: list[str] = []
    count = 0
    for name, module in list(model.named_modules()):  # the embedding may be replaced
        if isinstance(module, Linear):
            if id(module) in routers or (module is model.lm_head and not lm_head):
                continue
            if not can_quantize(module.weight):
                kept.append(name)
                continue
            table = module.quantize(batch_invariant)
            count += 1
            if module is model.lm_head and model.config.tie_word_embeddings:
                # Same lookup contract as nn.Embedding (ids -> rows in the model's dtype).
                model.model.embed_tokens = QuantizedEmbedding(  # type: ignore[assignment]
                    table, model.model.norm.weight.dtype
                )
        elif isinstance(module, Experts):
            if can_quantize(module.gate_up_proj) and can_quantize(module.down_proj):
                module.quantize(batch_invariant)
                count += 1
            else:
                kept.append(name)
    return _summary(count, kept, lm_head)


@torch.no_grad()
def dequantize_model(model: NativeCausalLM) -> None:
    """Give a quantized ``model`` back dense weights equal to its int8 ones dequantised:
    the reference its kernels are measured against (tests, ``bench/quantization.py``),
    whose only difference from the int8 model is how each matmul is computed."""
    dtype = model.model.norm.weight.dtype
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is not None:
            module.weight = nn.Parameter(module.quantized.dequantize(dtype), requires_grad=False)
            module.quantized = None
        elif isinstance(module, Experts) and module.int8 is not None:
            for i, stack in enumerate(("gate_up_proj", "down_proj")):
                dense = torch.stack([pair[i].dequantize(dtype) for pair in module.int8])
                setattr(module, stack, nn.Parameter(dense, requires_grad=False))
            module.int8 = None
    embedding = model.model.embed_tokens
    if isinstance(embedding, QuantizedEmbedding):
        model.model.embed_tokens = nn.Embedding.from_pretrained(embedding.table.dequantize(dtype))
        model.tie_weights()


def int8_weights(model: nn.Module) -> list[QuantizedWeight]:
    """Every int8 weight of a quantized ``model``: its projections' and its experts'."""
    weights: list[QuantizedWeight] = []
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is not None:
            weights.append(module.quantized)
        elif isinstance(module, Experts) and module.int8 is not None:
            weights.extend(weight for pair in module.int8 for weight in pair)
    return weights


def quantize_activations(model: NativeCausalLM) -> int:
    """Turn a quantized ``model``'s int8 weights into w8a8 ones (``w8a8_weight.py``), the
    tied embedding's table with its head's; returns how many it turned."""
    if not w8a8_available():
        raise QuantizationError(
            "--quantization w8a8 needs the engine's compiled kernels at level "
            f"{W8A8_LEVEL}, which are not loaded"
        )
    return pack_int8_weights(model, activation_parts=1)


def int8_takes_vnni_kernel(dtype: torch.dtype) -> bool:
    """Whether ``--quantization int8`` runs on the w8a8 kernel with each row of activations
    in two int8 parts (~15 bits: ``w8a8_weight.py``): for bf16 rows where the kernel is
    built and no AMX runs (there oneDNN's tiles take int8 batches: ``int8_weight.py``). On
    the Zen 4 EPYC it beat the weight-only kernels it replaced at every row count up to 64
    (docs/quantization.md)."""
    return dtype == torch.bfloat16 and w8a8_available() and not tiles_available()


def pack_int8_weights(model: NativeCausalLM, activation_parts: int) -> int:
    """Pack a quantized ``model``'s int8 weights for the w8a8 kernel, its activations in
    ``activation_parts`` int8 parts a row (1 for w8a8, 2 for int8), the tied embedding's
    table with its head's; returns how many it packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.quantized, Int8Weight):
            module.quantized = W8A8Weight.pack(module.quantized, activation_parts)
            count += 1
        elif isinstance(module, Experts) and module.int8 is not None:
            module.int8 = [
                (_packed(a, activation_parts), _packed(b, activation_parts)) for a, b in module.int8
            ]
            count += 2 * len(module.int8)
    embedding = model.model.embed_tokens
    if isinstance(embedding, QuantizedEmbedding) and model.lm_head.quantized is not None:
        embedding.table = model.lm_head.quantized
    return count


def _packed(weight: QuantizedWeight, activation_parts: int) -> W8A8Weight:
    if isinstance(weight, W8A8Weight):
        return weight
    return W8A8Weight.pack(weight, activation_parts)


def use_int8_kernel(model: nn.Module, enabled: bool = True) -> int:
    """Switch ``model``'s int8 matmuls to the engine's compiled kernel (``enabled``) or to
    torch's (a comparison's baseline: ``bench/quantization.py``, the tests); returns how
    many weights it switched. Enabling needs the kernel library loaded."""
    if enabled and not is_registered(ROWS_KERNEL):
        raise RuntimeError(f"torch.ops.tokenline.{ROWS_KERNEL} is not loaded")
    weights = [w for w in int8_weights(model) if isinstance(w, Int8Weight)]
    for weight in weights:
        weight.kernel = enabled
    return len(weights)


def _summary(count: int, kept: list[str], lm_head: bool) -> str:
    line = f"int8 weights: {count} projections" + (", LM head included" if lm_head else "")
    if kept:
        line += f"; {len(kept)} kept in full precision (input width not a multiple of 16)"
    return line
