"""A live four-process stack on free loopback ports, shared by a test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launch import LocalStack, StackPorts


@pytest.fixture(scope="module")
def stack(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    logs = tmp_path_factory.mktemp("stack-logs")
    stack = LocalStack(
        str(default_model_dir),
        StackPorts.free(),
        scheduler_args=["--kv-cache-tokens", "16384", "--num-threads", "1"],
        log_dir=logs,
    )
    try:
        stack.start()
    except BaseException:
        for log in sorted(logs.glob("*.log")):
            print(f"---- {log.name}\n{log.read_text(errors='replace')[-4000:]}")
        raise
    yield stack
    stack.stop()
