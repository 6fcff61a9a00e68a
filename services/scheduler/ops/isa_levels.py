"""The vector ISA levels the CPU kernels are built for, and which one this machine runs.

One library per level, so an image can carry all of them, built where a compiler is, and
a scheduler picks its own at start from the CPU's flags alone (no compiler, no probe).
The flags are the ones torch's own CPU code generator uses per level, so ``at::vec``
inside the kernels takes the same implementation torch's kernels do.

torch's ``get_cpu_capability()`` says ``AVX512`` both with and without AVX-512 BF16, so
the choice reads ``/proc/cpuinfo``. The kernels issue no AMX instructions: an AMX CPU runs
the ``avx512_bf16`` build. ``ATEN_CPU_CAPABILITY`` caps the level as it caps torch's own
kernels, so one machine can run the code paths of a lesser one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class IsaLevel:
    name: str
    cpu_flags: frozenset[str]  # what /proc/cpuinfo must list for the code to run
    build_flags: tuple[str, ...]  # the compiler's, including at::vec's CPU_CAPABILITY macro
    aten_rank: int  # its place in ATEN_CPU_CAPABILITY's order: default < avx2 < avx512


_AVX512_CPU = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512vl", "avx512bw"})
_AVX512_BUILD = ("-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma")

LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("baseline", frozenset(), (), 0),
    IsaLevel(
        "avx2",
        frozenset({"avx2", "fma", "f16c"}),
        ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"),
        1,
    ),
    IsaLevel("avx512", _AVX512_CPU, (*_AVX512_BUILD, "-DCPU_CAPABILITY_AVX512"), 2),
    IsaLevel(
        "avx512_bf16",
        _AVX512_CPU | {"avx512_bf16", "avx512_vnni"},
        (*_AVX512_BUILD, "-mavx512bf16", "-mavx512vnni", "-DCPU_CAPABILITY_AVX512"),
        2,
    ),
)
LEVEL_NAMES = tuple(level.name for level in LEVELS)
_CAP_RANKS = {"default": 0, "avx2": 1, "avx512": 2}


def level_named(name: str) -> IsaLevel:
    for level in LEVELS:
        if level.name == name:
            return level
    raise ValueError(f"unknown ISA level {name!r}; one of {', '.join(LEVEL_NAMES)}")


def machine_level(cpu_flags: frozenset[str] | None = None, cap: str | None = None) -> IsaLevel:
    """The highest level whose instructions this CPU has (``cpu_flags``, default
    /proc/cpuinfo's) within the ``ATEN_CPU_CAPABILITY`` cap (default: the environment's)."""
    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "") if cap is None else cap
    max_rank = _CAP_RANKS.get(cap.lower(), max(_CAP_RANKS.values()))
    fitting = [lv for lv in LEVELS if lv.cpu_flags <= flags and lv.aten_rank <= max_rank]
    return fitting[-1]  # baseline always fits


def torch_cpu_has(probe_name: str) -> bool:
    """One of torch.cpu's private feature probes; False where this torch has no such probe."""
    probe = getattr(torch.cpu, probe_name, None)
    return bool(probe()) if callable(probe) else False


def has_amx() -> bool:
    """Whether the CPU has AMX tiles: there oneDNN's and torch's bf16 kernels multiply on
    them, and the engine's own pair-dot-product kernels step aside above a few rows."""
    return torch_cpu_has("_is_amx_tile_supported")


def read_cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux); elsewhere what torch reports, as a best effort."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability().lower()
    by_capability = {"avx2": LEVELS[1].cpu_flags, "avx512": _AVX512_CPU}
    return by_capability.get(capability, frozenset())
