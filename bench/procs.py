"""What a benchmark reads of the stack's processes from /proc (Linux): resident memory,
CPU time, and the engine process the scheduler starts as its child."""

from __future__ import annotations

import os
from pathlib import Path

from services.launch import LocalStack

SERVICES = ("gateway", "frontend", "scheduler", "detokenizer")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def read_rss_mib(pid: int) -> float:
    """VmRSS of one process (0.0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, all its threads (0.0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime


def child_pids(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def stack_pids(stack: LocalStack) -> dict[str, list[int]]:
    """Each service's process, and ``engine``: the scheduler's engine process (none when
    the scheduler runs its engine on a thread)."""
    pids = {name: [stack.procs[name].pid] for name in SERVICES}
    return pids | {"engine": child_pids(stack.procs["scheduler"].pid)}
