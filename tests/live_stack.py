"""One way for tests to run a live four-process stack and see its logs on failure."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from services.launch import LocalStack, StackPorts


def dump_logs(log_dir: Path) -> None:
    """Service logs to the real stderr (past pytest's capture), for a failing run."""
    for log in sorted(log_dir.glob("*.log")):
        print(f"---- {log.name}\n{log.read_text(errors='replace')[-6000:]}", file=sys.__stderr__)


@contextmanager
def running_stack(
    model_dir: Path,
    log_dir: Path,
    request: pytest.FixtureRequest | None = None,
    **stack_args: Any,
) -> Iterator[LocalStack]:
    """Start the stack on free ports; stop it after. Logs are dumped when start-up
    fails, and (given ``request``) when a test failed while the stack was up."""
    stack = LocalStack(str(model_dir), StackPorts.free(), log_dir=log_dir, **stack_args)
    failed_before = request.session.testsfailed if request is not None else 0
    try:
        stack.start()
    except BaseException:
        dump_logs(log_dir)
        raise
    try:
        yield stack
    finally:
        stack.stop()
        if request is not None and request.session.testsfailed > failed_before:
            dump_logs(log_dir)


def module_stack(log_name: str, **stack_args: Any) -> Any:
    """A module-scoped ``stack`` fixture: a live stack started with ``stack_args`` (extra
    flags per service), logs in a temporary folder named ``log_name``, dumped when a test
    of the module fails. Assign it to ``stack`` at module level."""

    @pytest.fixture(scope="module")
    def stack(
        default_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory,
        request: pytest.FixtureRequest,
    ) -> Iterator[LocalStack]:
        log_dir = tmp_path_factory.mktemp(log_name)
        with running_stack(default_model_dir, log_dir, request, **stack_args) as live:
            yield live

    return stack
