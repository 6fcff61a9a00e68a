"""The memory a process may use: the machine's, capped by a cgroup limit where one is set
(read from the cgroup files; here from files written by the test)."""

from __future__ import annotations

from pathlib import Path

from services.common.memory import cgroup_limit_bytes, physical_memory_bytes, usable_memory_bytes


def test_a_numeric_cgroup_limit_caps_the_machines_memory(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text(f"{2**30}\n")
    assert cgroup_limit_bytes((v2, v1)) == 2**30
    assert usable_memory_bytes((v2, v1)) == min(2**30, physical_memory_bytes())


def test_no_limit_leaves_the_machines_memory(tmp_path: Path) -> None:
    v2, missing = tmp_path / "memory.max", tmp_path / "absent"
    v2.write_text("max\n")  # cgroup v2's "unlimited"
    assert cgroup_limit_bytes((v2, missing)) is None
    assert cgroup_limit_bytes((missing,)) is None
    assert usable_memory_bytes((v2, missing)) == physical_memory_bytes() > 2**27


def test_a_v1_limit_is_read_when_v2_has_none(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    v1.write_text(f"{3 * 2**30}\n")
    assert cgroup_limit_bytes((v2, v1)) == 3 * 2**30
