"""What machine a benchmark ran on: machines of one kind differ (AVX2-only EPYCs, Xeons
with AVX-512 BF16), and a figure means little without the CPU beside it."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

# The CPU flags that decide how fast this project's kernels run here.
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def cpu_model_and_flags(cpuinfo: str) -> tuple[str, list[str]]:
    """(model name, the relevant flags present) from /proc/cpuinfo text."""
    model, flags = platform.processor() or "unknown", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    return model, [f for f in RELEVANT_FLAGS if f in flags]


def machine_info() -> dict[str, Any]:
    """CPU model and flags, core count, torch version and threads, and the GPU if any."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text(errors="replace") if cpuinfo.exists() else ""
    model, flags = cpu_model_and_flags(text)
    info: dict[str, Any] = {
        "cpu": model,
        "cpu_flags": flags,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def describe(info: dict[str, Any]) -> str:
    """One line for printed reports."""
    flags = ",".join(info["cpu_flags"]) or "no AVX2"
    gpu = f"; GPU {info['gpu']}" if "gpu" in info else ""
    return f"{info['cpu']} ({info['cpu_count']} cores; {flags}); torch {info['torch']}{gpu}"
