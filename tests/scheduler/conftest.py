"""The engine's compiled kernels (services/scheduler/ops/cpu_kernels.py), built once per
test session with the machine's C++ compiler and loaded into this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.ops.cpu_kernels import SampleKernel, build, find_compiler, kernel_path

NO_COMPILER = "the kernels need a C++ compiler"
needs_compiler = pytest.mark.skipif(find_compiler() is None, reason=NO_COMPILER)


@pytest.fixture(scope="session")
def kernel_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory whose kernels/ holds this machine's build, loaded here."""
    model_dir = tmp_path_factory.mktemp("kernels-model")
    path = build(model_dir)
    assert path == kernel_path(model_dir) and path.is_file()
    assert SampleKernel.load(model_dir) is not None
    return model_dir
