"""Fixtures for bench/serve tests: the real tokenizer. The live ``stack`` is the suite's
(tests/conftest.py): fresh per module, so a benchmark's warm-up is its first traffic."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from services.common.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(default_model_dir)
