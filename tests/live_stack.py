"""How tests run live stacks of real service processes, and see their logs on failure.

Starting a stack costs seconds (each process loads the 129k-entry tokenizer), so the
suite shares what it can:

* ``shared_stack``: one four-process stack for the whole session, for every module whose
  flags are the defaults below. Modules ask for it as ``stack`` (tests/conftest.py).
* ``front_half(...)``: a module's own frontend and gateway, with its own flags, on the
  shared scheduler and detokenizer (a cluster of several frontends is a shape tokenline
  serves anyway).
* ``module_stack(...)``: a scheduler, frontend and gateway of a module's own, for
  scheduler flags, pushing to the shared detokenizer; all four for detokenizer flags or
  tests that kill it.

Each process started here is stopped by its PID (``LocalStack.stop``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.launch import LocalStack, StackPorts
from tests.waiting import wait_until

# The shared stack's scheduler: a pool big enough for every module that shares it, one
# torch thread (the suite runs beside it), batch-invariant decoding, so the tests that
# compare a request alone and in company hold on every CPU (docs/batch-invariance.md), and
# float32 set explicitly. ``--dtype auto`` follows the CPU (bf16 where it computes bf16
# natively), and the switch does not cover a prompt whose prefix the radix cache supplies:
# in bf16 that one last token, computed over cached K/V, lands a bf16 rounding away from
# the full prefill (seen on an Intel Xeon with AMX: a seeded stream differed from its
# unary twin, an embedding of a text from that of its token ids by 8e-3). The bf16 paths
# are proven in-process, per ISA cap (test_batch_invariance.py); `auto` serves the stacks
# of test_limits.py and test_health.py.
SHARED_SCHEDULER_ARGS = [
    *["--kv-cache-tokens", "16384", "--num-threads", "1", "--batch-invariant"],
    *["--dtype", "float32"],
]
# What the next module may wait for the shared stack to finish of the last one's work
# (aborted streams still draining): generous, since only a leak would reach it.
SETTLE_S = 60.0


def dump_logs(log_dir: Path) -> None:
    """Service logs to the real stderr (past pytest's capture), for a failing run."""
    for log in sorted(log_dir.glob("*.log")):
        print(f"---- {log.name}\n{log.read_text(errors='replace')[-6000:]}", file=sys.__stderr__)


@contextmanager
def running_stack(
    model_dir: Path,
    log_dir: Path,
    request: pytest.FixtureRequest | None = None,
    *,
    ports: StackPorts | None = None,
    only: tuple[str, ...] = (),
    **stack_args: Any,
) -> Iterator[LocalStack]:
    """Start the stack (or ``only`` those services) on free ports, or ``ports``; stop it
    after. Logs are dumped when start-up fails, and (given ``request``) when a test
    failed while the stack was up."""
    stack = LocalStack(str(model_dir), ports or StackPorts.free(), log_dir=log_dir, **stack_args)
    failed_before = request.session.testsfailed if request is not None else 0
    try:
        stack.start(only=only)
    except BaseException:
        dump_logs(log_dir)
        raise
    try:
        yield stack
    finally:
        stack.stop()
        if request is not None and request.session.testsfailed > failed_before:
            dump_logs(log_dir)


def finish_counts(stack: LocalStack) -> dict[str, float]:
    """Requests that left the scheduler so far, by finish reason, from its own metrics."""
    text = httpx.get(stack.ports.metrics_url("scheduler"), timeout=5).text
    return {
        sample.labels["finished_reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tokenline:request_success_total"
    }


def wait_for_finishes(
    stack: LocalStack, before: dict[str, float], total: int, limit_s: float = SETTLE_S
) -> dict[str, int]:
    """Until ``total`` more requests left the scheduler than at ``before`` and it is idle;
    returns how many left by each reason since. A freed request counts as "abort", a
    zombie that ran on to its length as "length". The metrics follow a step behind, so
    this waits; ``limit_s`` only bounds a failure, so it is generous."""

    def since() -> dict[str, int]:
        now = finish_counts(stack)
        return {r: int(n - before.get(r, 0)) for r, n in now.items() if n > before.get(r, 0)}

    wait_until(lambda: sum(since().values()) >= total, limit_s, f"{total} finishes", 0.05)
    wait_until(lambda: _scheduler_load(stack) == 0, limit_s, "an idle scheduler", 0.02)
    return since()


def _scheduler_load(stack: LocalStack) -> int:
    info = stack.scheduler_info()
    return info.num_waiting + info.num_running


def wait_until_settled(stack: LocalStack) -> None:
    """Until no service holds state for any request: the last module's work is done."""
    settled = {key: 0 for key in stack.live_state()}
    wait_until(lambda: stack.live_state() == settled, SETTLE_S, "a settled stack", 0.05)


def ports_beside(shared: StackPorts, *shared_services: str) -> StackPorts:
    """Free ports for a module's own services, except ``shared_services``, which are the
    session stack's (``shared``)."""
    kept = {name: getattr(shared, name) for name in shared_services}
    return dataclasses.replace(StackPorts.free(), **kept)


@pytest.fixture(scope="session")
def shared_stack(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    """The session's four-process stack with ``SHARED_SCHEDULER_ARGS``."""
    log_dir = tmp_path_factory.mktemp("shared-stack-logs")
    with running_stack(default_model_dir, log_dir, scheduler_args=SHARED_SCHEDULER_ARGS) as live:
        yield live


@pytest.fixture(scope="module")
def stack(shared_stack: LocalStack, request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    """The shared stack, settled for this module; its logs are dumped if a test here fails."""
    wait_until_settled(shared_stack)
    failed_before = request.session.testsfailed
    yield shared_stack
    if request.session.testsfailed > failed_before and shared_stack.log_dir is not None:
        dump_logs(shared_stack.log_dir)


def front_half(log_name: str, **stack_args: Any) -> Any:
    """A module-scoped ``stack`` fixture: the module's own frontend and gateway (started
    with ``stack_args``: ``frontend_args``, ``gateway_args``) on the shared scheduler and
    detokenizer. Assign it to ``stack`` at module level."""

    @pytest.fixture(scope="module")
    def stack(
        shared_stack: LocalStack,
        default_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory,
        request: pytest.FixtureRequest,
    ) -> Iterator[LocalStack]:
        wait_until_settled(shared_stack)
        ports = ports_beside(shared_stack.ports, "scheduler", "detokenizer")
        log_dir = tmp_path_factory.mktemp(log_name)
        only = ("frontend", "gateway")
        with running_stack(
            default_model_dir, log_dir, request, ports=ports, only=only, **stack_args
        ) as live:
            yield live

    return stack


def module_stack(log_name: str, *, own_detokenizer: bool = False, **stack_args: Any) -> Any:
    """A module-scoped ``stack`` fixture: a live stack of the module's own, started with
    ``stack_args`` (extra flags per service), logs in a temporary folder named
    ``log_name``, dumped when a test of the module fails. Assign it to ``stack`` at
    module level.

    Its scheduler pushes to the session stack's detokenizer (a detokenizer serves any
    number of schedulers, as in a cluster), which saves a process start; a module that
    gives the detokenizer flags, or sets ``own_detokenizer`` because it kills or restarts
    it, starts all four."""
    own_detokenizer = own_detokenizer or "detokenizer_args" in stack_args

    @pytest.fixture(scope="module")
    def stack(
        default_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory,
        request: pytest.FixtureRequest,
    ) -> Iterator[LocalStack]:
        ports: StackPorts | None = None
        only: tuple[str, ...] = ()
        if not own_detokenizer:
            shared_stack: LocalStack = request.getfixturevalue("shared_stack")
            wait_until_settled(shared_stack)
            ports = ports_beside(shared_stack.ports, "detokenizer")
            only = ("scheduler", "frontend", "gateway")
        log_dir = tmp_path_factory.mktemp(log_name)
        with running_stack(
            default_model_dir, log_dir, request, ports=ports, only=only, **stack_args
        ) as live:
            yield live

    return stack
