"""The one table of dtype names, and what ``--dtype auto`` serves a checkpoint in.

``auto`` keeps the checkpoint's dtype where the hardware computes it natively and
otherwise takes float32 (CPU) or float16 (CUDA). The reason is speed: on a CPU without
AVX512_BF16 or AMX (an AVX2-only AMD EPYC, say) torch emulates bf16 matmuls, reported
2.5x slower than float32 there. An explicit dtype is always taken as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.scheduler.ops.isa_levels import has_amx, torch_cpu_has

AUTO = "auto"
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype a name in DTYPES stands for; ValueError for any other name."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose {AUTO}, {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name flags, logs and GetInfo use."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class HardwareCaps:
    """What the device computes natively; ``detect`` asks torch, tests build their own."""

    has_avx512_bf16: bool = False
    has_amx: bool = False  # AMX tiles; every CPU with them has AMX-BF16
    has_amx_fp16: bool = False
    has_cuda_bf16: bool = False  # compute capability >= 8.0 (emulation does not count)

    @classmethod
    def detect(cls, device: torch.device) -> HardwareCaps:
        if device.type == "cuda":
            with torch.cuda.device(device):
                return cls(has_cuda_bf16=torch.cuda.is_bf16_supported(including_emulation=False))
        return cls(
            has_avx512_bf16=torch_cpu_has("_is_avx512_bf16_supported"),
            has_amx=has_amx(),
            has_amx_fp16=torch_cpu_has("_is_amx_fp16_supported"),
        )


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line for the start-up log, e.g. "auto: CPU has AVX512_BF16"

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)


def choose_dtype(
    requested: str | torch.dtype | None,
    checkpoint: torch.dtype,
    device: torch.device,
    capabilities: HardwareCaps | None = None,
) -> DtypeChoice:
    """The dtype to serve a ``checkpoint``-dtype model in on ``device``.

    ``requested`` None or "auto" chooses by the hardware (``capabilities``, detected
    when not given); a dtype or a name from DTYPES is taken as given.
    """
    if requested is not None and requested != AUTO:
        dtype = requested if isinstance(requested, torch.dtype) else dtype_from_name(requested)
        return DtypeChoice(dtype, f"{dtype_name(dtype)} as requested")
    caps = capabilities or HardwareCaps.detect(device)
    if device.type == "cpu":
        return _auto_on_cpu(checkpoint, caps)
    if device.type == "cuda":
        return _auto_on_cuda(checkpoint, caps)
    return DtypeChoice(checkpoint, f"auto: the checkpoint's dtype on {device.type}")


def _auto_on_cpu(checkpoint: torch.dtype, caps: HardwareCaps) -> DtypeChoice:
    if checkpoint == torch.bfloat16:
        feature = "AMX" if caps.has_amx else "AVX512_BF16" if caps.has_avx512_bf16 else None
        if feature is not None:
            return DtypeChoice(torch.bfloat16, f"auto: CPU has {feature}")
        return DtypeChoice(torch.float32, "auto: CPU lacks native bf16 (no AVX512_BF16/AMX)")
    if checkpoint == torch.float16:
        if caps.has_amx_fp16:
            return DtypeChoice(torch.float16, "auto: CPU has AMX-FP16")
        return DtypeChoice(torch.float32, "auto: CPU lacks native fp16 (no AMX-FP16)")
    return DtypeChoice(checkpoint, f"auto: the checkpoint's {dtype_name(checkpoint)}")


def _auto_on_cuda(checkpoint: torch.dtype, caps: HardwareCaps) -> DtypeChoice:
    if checkpoint == torch.bfloat16 and not caps.has_cuda_bf16:
        return DtypeChoice(torch.float16, "auto: GPU lacks native bf16 (compute capability < 8)")
    return DtypeChoice(checkpoint, f"auto: the checkpoint's {dtype_name(checkpoint)}")
