"""A live four-process stack on free loopback ports, shared by a test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launch import LocalStack
from tests.live_stack import running_stack


@pytest.fixture(scope="module")
def stack(
    default_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalStack]:
    with running_stack(
        default_model_dir,
        tmp_path_factory.mktemp("stack-logs"),
        request,
        scheduler_args=["--kv-cache-tokens", "16384", "--num-threads", "1"],
    ) as stack:
        yield stack
