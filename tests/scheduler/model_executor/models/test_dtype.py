"""What `--dtype auto` picks on CPU and CUDA with given capabilities, and explicit dtypes."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.model_executor.models.dtype import (
    AUTO,
    DTYPES,
    HardwareCaps,
    choose_dtype,
    dtype_from_name,
    dtype_name,
)
from services.scheduler.ops.isa_levels import torch_cpu_has

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NO_CAPS = HardwareCaps()
AVX512_BF16 = HardwareCaps(has_avx512_bf16=True)
AMX = HardwareCaps(has_amx=True)
AMX_FP16 = HardwareCaps(has_amx=True, has_amx_fp16=True)
CUDA_BF16 = HardwareCaps(has_cuda_bf16=True)


@pytest.mark.parametrize(
    ("checkpoint", "device", "caps", "expected", "reason"),
    [
        # CPU, bf16 checkpoint: bf16 only where the CPU computes it natively
        (BF16, CPU, AVX512_BF16, BF16, "auto: CPU has AVX512_BF16"),
        (BF16, CPU, AMX, BF16, "auto: CPU has AMX"),
        (BF16, CPU, NO_CAPS, FP32, "auto: CPU lacks native bf16 (no AVX512_BF16/AMX)"),
        (BF16, CPU, CUDA_BF16, FP32, "auto: CPU lacks native bf16 (no AVX512_BF16/AMX)"),
        # CPU, fp16 checkpoint: fp16 only with AMX-FP16
        (FP16, CPU, AMX_FP16, FP16, "auto: CPU has AMX-FP16"),
        (FP16, CPU, AVX512_BF16, FP32, "auto: CPU lacks native fp16 (no AMX-FP16)"),
        # an fp32 checkpoint stays fp32 whatever the hardware could do
        (FP32, CPU, AMX_FP16, FP32, "auto: the checkpoint's float32"),
        (FP32, CUDA, CUDA_BF16, FP32, "auto: the checkpoint's float32"),
        # CUDA: the checkpoint's dtype, bf16 falling back to fp16 before compute capability 8
        (BF16, CUDA, CUDA_BF16, BF16, "auto: the checkpoint's bfloat16"),
        (BF16, CUDA, AVX512_BF16, FP16, "auto: GPU lacks native bf16 (compute capability < 8)"),
        (FP16, CUDA, NO_CAPS, FP16, "auto: the checkpoint's float16"),
    ],
)
def test_auto_by_hardware(
    checkpoint: torch.dtype,
    device: torch.device,
    caps: HardwareCaps,
    expected: torch.dtype,
    reason: str,
) -> None:
    for requested in (AUTO, None):
        choice = choose_dtype(requested, checkpoint, device, caps)
        assert (choice.dtype, choice.reason) == (expected, reason)


@pytest.mark.parametrize("requested", ["bfloat16", torch.bfloat16])
def test_an_explicit_dtype_wins(requested: str | torch.dtype) -> None:
    for device, caps in ((CPU, NO_CAPS), (CUDA, NO_CAPS), (CPU, AMX_FP16)):
        choice = choose_dtype(requested, FP32, device, caps)
        assert (choice.name, choice.reason) == ("bfloat16", "bfloat16 as requested")


def test_an_unknown_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; choose auto, bfloat16"):
        choose_dtype("fp8", BF16, CPU, NO_CAPS)


def test_names_round_trip() -> None:
    for name, dtype in DTYPES.items():
        assert dtype_from_name(name) is dtype and dtype_name(dtype) == name


def test_detection_on_this_machine() -> None:
    """The real probes answer; a probe this torch lacks reads as False, not an error."""
    caps = HardwareCaps.detect(CPU)
    assert not caps.has_cuda_bf16
    assert caps.has_avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
    assert caps.has_amx == torch.cpu._is_amx_tile_supported()
    assert torch_cpu_has("_is_no_such_feature_supported") is False
    assert choose_dtype(AUTO, FP32, CPU).dtype == FP32  # detected, yet fp32 stays fp32
