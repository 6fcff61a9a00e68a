"""The tiny checkpoints the int8 and w8a8 tests share (``quantized_reference.py`` has the
dense model they are held against)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import build_hf_model, save_checkpoint


@pytest.fixture(scope="session")
def qwen3_checkpoints(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> dict[str, Path]:
    """Tiny random checkpoints: fused q/k/v and gate/up, q/k norms, a tied head; experts
    beside a dense layer in the MoE one."""
    return {
        name: save_checkpoint(
            build_hf_model(name), tmp_path_factory.mktemp(name), default_model_dir
        )
        for name in ("qwen3", "qwen3_moe")
    }
