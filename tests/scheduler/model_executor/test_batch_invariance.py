"""``--batch-invariant``: a request's logits and greedy tokens are bit-identical alone and in
any batch, on every ISA level this CPU can be capped to.

oneDNN (``ONEDNN_MAX_CPU_ISA``) and ATen (``ATEN_CPU_CAPABILITY``) pick their kernels once,
at process start, at or below what the CPU has; so each level runs the probe
(``batch_invariance_probe.py``) in a subprocess of its own. A cap cannot add what the CPU
lacks: the AMX level is checked only on a CPU with AMX.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from services.scheduler.ops.isa_levels import read_cpu_flags

pytestmark = pytest.mark.live

REPO_ROOT = Path(__file__).resolve().parents[3]

# (oneDNN cap, ATen capability, CPU flags it needs), lowest first: the levels of the machines
# this project runs on (AVX2 only, AVX-512 BF16, AMX). SSE4.1 and AVX-512 without BF16 are
# no such machine, and their probes took 19 and 11 of the suite's seconds.
ISA_LEVELS = (
    ("AVX2", "avx2", {"avx2", "fma"}),
    ("AVX512_CORE_BF16", "avx512", {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
    ("AVX512_CORE_AMX", "avx512", {"avx512_bf16", "amx_tile", "amx_bf16"}),
)


def levels_this_cpu_has() -> list[tuple[str, str]]:
    flags = read_cpu_flags()
    return [(onednn, aten) for onednn, aten, needs in ISA_LEVELS if needs <= flags]


LEVELS = levels_this_cpu_has() if platform.machine() in ("x86_64", "AMD64") else []


def run_probe(model_dir: Path, level: tuple[str, str]) -> list[dict]:
    """The probe's reports under ``level``'s caps. Our compiled kernels are checked only
    at the CPU's own (highest) level: under a lower cap the scheduler would pick a lower
    kernel level, which `make model` does not build."""
    env = dict(os.environ)
    command = [sys.executable, "-m", "tests.scheduler.model_executor.batch_invariance_probe"]
    command += ["--model", str(model_dir)]
    if level[0] != "uncapped":
        env |= {"ONEDNN_MAX_CPU_ISA": level[0], "ATEN_CPU_CAPABILITY": level[1]}
    if LEVELS and level != LEVELS[-1]:
        command.append("--skip-kernel")
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("level", LEVELS or [("uncapped", "uncapped")], ids=lambda level: level[0])
def test_a_request_is_bit_identical_alone_and_in_any_batch(
    level: tuple[str, str], default_model_dir: Path
) -> None:
    reports = run_probe(default_model_dir, level)
    assert {r["dtype"] for r in reports} == {"bfloat16", "float32"}
    for report in reports:
        assert report["steps"] > 0
        assert report["differences"] == [], report
