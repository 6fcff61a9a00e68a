"""Shared fixtures: the embedded default model, built once per checkout, and a live stack."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from hypothesis import settings

from services.common.default_model import ensure_default_model
from tests.live_stack import shared_stack, stack

if TYPE_CHECKING:
    from tests.tls_certs import CertFiles

# Property tests draw the same examples on every run, so `make test` passes or fails the same
# way on every machine; `pytest --hypothesis-profile=explore` draws fresh ones to hunt bugs.
# No per-example deadline: that is a timing assertion, and `make test` runs two workers on
# two cores beside live stacks.
settings.register_profile("default", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile("default")


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker takes its share of the cores for in-process torch. By default every
    worker opens one OpenMP thread per core, so two workers on two cores (beside live stacks,
    whose schedulers run one thread each) oversubscribe: tests/scheduler took 142 s of
    pytest time that way against 83 s with one thread per worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


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


# Fixtures whose tests run against live service processes.
LIVE_FIXTURES = {"stack", "shared_stack", "client", "two_schedulers"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test gets one tier: ``live`` (it starts processes: declared by its module, or
    it takes a live stack), ``tooling`` (declared: linters, manifests, docs), else ``unit``
    (in-process; ``make test-fast`` runs only these)."""
    for item in items:
        if LIVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.live)
        if not {m.name for m in item.iter_markers()} & {"live", "tooling"}:
            item.add_marker(pytest.mark.unit)


# ``stack``: the session's shared four-process stack (tests/live_stack.py). A module that
# needs other flags defines its own: ``stack = front_half(...)`` for frontend or gateway
# flags, ``stack = module_stack(...)`` for the scheduler's or detokenizer's.
__all__ = ["shared_stack", "stack"]
