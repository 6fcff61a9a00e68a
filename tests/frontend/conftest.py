"""The real tokenizer of the embedded default model, loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from services.common.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(default_model_dir)
