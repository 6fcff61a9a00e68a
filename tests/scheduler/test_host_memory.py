"""keep_freed_memory: a step's big buffers come back without fresh page faults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.scheduler.host_memory import keep_freed_memory

# Allocates and fills a 16 MiB tensor twice, printing the minor page faults of the second
# (from /proc/self/stat), after calling keep_freed_memory() when argv[1] is "keep".
_PROBE = """
import sys, torch
from services.scheduler.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def minor_faults():
    return int(open("/proc/self/stat").read().rpartition(")")[2].split()[7])
buffer = torch.empty(4 * 2**20).fill_(1.0)
del buffer
before = minor_faults()
buffer = torch.empty(4 * 2**20).fill_(2.0)
print(minor_faults() - before)
"""


def faults_of_a_second_buffer(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and glibc")
def test_a_freed_16_mib_buffer_is_reused_instead_of_faulted_in_again() -> None:
    assert keep_freed_memory()
    fresh = faults_of_a_second_buffer("default")
    kept = faults_of_a_second_buffer("keep")
    assert fresh >= 1_000  # 4,096 pages of 4 KiB, zero-filled again by the kernel
    assert kept < fresh // 10
