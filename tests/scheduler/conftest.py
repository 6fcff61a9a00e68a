"""The engine's compiled kernels (services/scheduler/ops/cpu_kernels.py), built once per
machine with its C++ compiler (``make model`` does, into the default model's folder) and
loaded into this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.ops.cpu_kernels import KERNEL_DIR, SampleKernel, build, find_compiler
from services.scheduler.ops.isa_levels import machine_level

NO_COMPILER = "the kernels need a C++ compiler"
needs_compiler = pytest.mark.skipif(find_compiler() is None, reason=NO_COMPILER)


@pytest.fixture(scope="session")
def kernel_model_dir(default_model_dir: Path) -> Path:
    """The default model's folder, whose kernels/ holds this machine's build (``make model``
    built it; built here if not), loaded into this process. Read only: a test that changes
    a model folder copies it."""
    model_dir = default_model_dir
    built = build(model_dir / KERNEL_DIR)  # a no-op where the library for this key is there
    assert built[machine_level().name].is_file()
    assert SampleKernel.load(model_dir) is not None
    return model_dir
