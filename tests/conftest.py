"""Shared fixtures: the embedded default model, built once per checkout, and a live stack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from services.common.default_model import ensure_default_model
from services.launch import LocalStack
from tests.live_stack import running_stack

if TYPE_CHECKING:
    from tests.tls_certs import CertFiles

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "tokenline-tiny"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """``<repo>/models/tokenline-tiny``, built on first use (file-locked, atomic swap)."""
    return ensure_default_model(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="session")
def tls_certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    """A throwaway CA, loopback server cert and client cert (tests/tls_certs.py)."""
    from tests.tls_certs import make_certs  # cryptography only where TLS is tested

    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stack(
    default_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalStack]:
    """A fresh four-process stack per test module, logs dumped if a test fails.

    Modules that need other flags define their own ``stack``.
    """
    with running_stack(
        default_model_dir,
        tmp_path_factory.mktemp("stack-logs"),
        request,
        scheduler_args=["--kv-cache-tokens", "16384", "--num-threads", "1"],
    ) as stack:
        yield stack
