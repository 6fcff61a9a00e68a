"""Shared fixtures: the embedded default model, built once per checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.default_model import ensure_default_model

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "tokenline-tiny"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """``<repo>/models/tokenline-tiny``, built on first use (file-locked, atomic swap)."""
    return ensure_default_model(DEFAULT_MODEL_DIR)
