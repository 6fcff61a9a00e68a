"""A live four-process stack on free loopback ports, shared by a test module."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launch import LocalStack, StackPorts


def dump_logs(log_dir: Path) -> None:
    """Service logs to the real stderr (past pytest's capture), for a failing run."""
    for log in sorted(log_dir.glob("*.log")):
        print(f"---- {log.name}\n{log.read_text(errors='replace')[-6000:]}", file=sys.__stderr__)


@pytest.fixture(scope="module")
def stack(
    default_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalStack]:
    logs = tmp_path_factory.mktemp("stack-logs")
    stack = LocalStack(
        str(default_model_dir),
        StackPorts.free(),
        scheduler_args=["--kv-cache-tokens", "16384", "--num-threads", "1"],
        log_dir=logs,
    )
    failed_before = request.session.testsfailed
    try:
        stack.start()
    except BaseException:
        dump_logs(logs)
        raise
    yield stack
    stack.stop()
    if request.session.testsfailed > failed_before:
        dump_logs(logs)
