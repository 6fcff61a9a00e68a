"""The memory this process may use: the machine's, capped by its cgroup's limit.

A container (docker-compose's ``mem_limit``, a Kubernetes pod's ``limits.memory``) sees the
host's physical memory in ``/proc/meminfo`` and ``sysconf``, but is killed at its cgroup's
limit, so a choice that spends memory by default (the scheduler's decode copy) has to
weigh it against the smaller of the two.
"""

from __future__ import annotations

import os
from pathlib import Path

# cgroup v2's limit, then v1's; "max" (v2) or a huge number (v1) means unlimited.
CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_limit_bytes(files: tuple[Path, ...] = CGROUP_LIMIT_FILES) -> int | None:
    """The first readable numeric limit among ``files``, or None where none is set."""
    for file in files:
        try:
            text = file.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def usable_memory_bytes(files: tuple[Path, ...] = CGROUP_LIMIT_FILES) -> int:
    physical = physical_memory_bytes()
    limit = cgroup_limit_bytes(files)
    return physical if limit is None else min(physical, limit)
