"""Fixtures for bench/serve tests: the real tokenizer, and a live stack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from services.common.tokenizer import load_tokenizer
from services.launch import LocalStack
from tests.live_stack import running_stack


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def stack(
    default_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalStack]:
    """A fresh stack: the first benchmark's warm-up is its first traffic."""
    with running_stack(
        default_model_dir,
        tmp_path_factory.mktemp("bench-stack-logs"),
        request,
        scheduler_args=["--kv-cache-tokens", "16384", "--num-threads", "1"],
    ) as stack:
        yield stack
