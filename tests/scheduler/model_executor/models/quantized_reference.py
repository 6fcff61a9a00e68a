"""The dense reference the int8 and w8a8 tests hold a quantized model against."""

from __future__ import annotations

from pathlib import Path

import torch

from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.loader import load_native
from services.scheduler.model_executor.models.quantization import (
    dequantize_model,
    quantize_model,
)


def dequantized_reference(checkpoint: Path, dtype: torch.dtype) -> NativeCausalLM:
    """The checkpoint's int8 weights dequantised into a dense model, run in ``dtype``."""
    model, _ = load_native(checkpoint, torch.float32, torch.device("cpu"))
    quantize_model(model)
    dequantize_model(model)
    return model.to(dtype).eval()
