"""transport/heap.py: after ``keep_heap`` glibc serves a large block from its heap (no
``mmap`` of its own), which is what spares every step its page faults; before, it maps one.
Each case runs in a fresh interpreter, so the test process's own heap is left as it was."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from services.scheduler.__main__ import parse_args

pytestmark = [
    pytest.mark.live,  # each case runs a fresh interpreter
    pytest.mark.skipif(
        platform.libc_ver()[0] != "glibc", reason="mallopt's parameters are glibc's"
    ),
]

# mallinfo2's fields (hblks: blocks served by mmap; arena: the heap's bytes), read around
# a 64 MiB buffer, far over glibc's default mmap threshold.
PROBE = """
import ctypes, json, sys
from services.scheduler.transport.heap import keep_heap
tuned = keep_heap() if sys.argv[1] == "tuned" else None
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
before = libc.mallinfo2()
block = ctypes.create_string_buffer(64 << 20)
after = libc.mallinfo2()
print(json.dumps({"tuned": tuned, "new_mmapped_blocks": after.hblks - before.hblks,
                  "heap_growth": after.arena - before.arena}))
"""


def probe(mode: str) -> dict[str, int | bool | None]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    ).stdout
    return dict(json.loads(out.splitlines()[-1]))


def test_a_large_block_comes_from_the_heap_once_tuned() -> None:
    default, tuned = probe("default"), probe("tuned")
    assert default["new_mmapped_blocks"] == 1  # glibc's default: a mapping of its own
    assert tuned["tuned"] is True
    assert tuned["new_mmapped_blocks"] == 0
    assert int(tuned["heap_growth"] or 0) >= 64 << 20  # served by the heap instead


def test_the_flag_is_on_by_default_and_can_be_turned_off() -> None:
    assert parse_args(["--model", "m"]).heap_tuning is True
    assert parse_args(["--model", "m", "--no-heap-tuning"]).heap_tuning is False
