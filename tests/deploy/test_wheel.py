"""The wheel the container image installs (`pip install .` into /opt/tokenline) holds what
the services read from their own package at run time, not just the Python modules."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from services.scheduler.ops.cpu_kernels import HEADERS, SOURCES

pytestmark = pytest.mark.live

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_the_kernel_sources(tmp_path: Path) -> None:
    """The scheduler keys and builds its CPU kernels from these files; an install without
    them crashed the scheduler at start (found by `make containers-test`)."""
    tree = tmp_path / "tree"  # a copy: an in-tree build would leave build/ in the checkout
    shutil.copytree(
        ROOT,
        tree,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "models", "build", "*.egg-info", "__pycache__", ".*cache"
        ),
    )
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(tree)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("tokenline-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {path.relative_to(ROOT).as_posix() for path in (*SOURCES, *HEADERS)}
    assert wanted <= names, sorted(wanted - names)
