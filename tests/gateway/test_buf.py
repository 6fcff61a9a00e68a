"""Proto hygiene: `buf lint` passes on the repo, and lint and breaking both bite.

The `buf` binary comes from the pinned `buf-bin` dev dependency; `make proto-check`
runs the same lint plus `buf breaking` against main.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.gen_protos import ROOT

pytestmark = pytest.mark.tooling


@pytest.fixture(autouse=True)
def fake() -> None:
    """No frontend here: override the gateway suite's autouse fake-frontend reset."""


def _buf_binary() -> str:
    found = Path(sys.executable).with_name("buf")
    path = str(found) if found.exists() else shutil.which("buf")
    if path is None:
        pytest.skip("no buf binary: install the dev extra (buf-bin)")
    try:
        subprocess.run([path, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"the buf binary cannot run here: {exc}")
    return path


def _buf(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_buf_binary(), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def workspace_copy(tmp_path: Path) -> Path:
    """buf.yaml and every module it names, copied so a test can break them."""
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    for module in ("proto", "third_party"):
        shutil.copytree(ROOT / module, tmp_path / module, ignore=shutil.ignore_patterns("*.py*"))
    return tmp_path


def test_buf_lint_passes() -> None:
    result = _buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_catches_a_violation(workspace_copy: Path) -> None:
    proto = workspace_copy / "proto" / "tokenline" / "v1" / "common.proto"
    proto.write_text(proto.read_text() + "\nmessage bad_name {\n  int32 BadField = 1;\n}\n")
    result = _buf("lint", cwd=workspace_copy)
    assert result.returncode != 0
    assert "bad_name" in result.stdout and "BadField" in result.stdout


def test_buf_breaking_catches_a_renumbered_field(workspace_copy: Path) -> None:
    proto = workspace_copy / "proto" / "tokenline" / "v1" / "common.proto"
    text = proto.read_text()
    assert "uint32 total_tokens = 3;" in text
    proto.write_text(text.replace("uint32 total_tokens = 3;", "uint32 total_tokens = 30;"))
    result = _buf("breaking", "proto", "--against", str(ROOT / "proto"), cwd=workspace_copy)
    assert result.returncode != 0
    assert "total_tokens" in result.stdout
    unchanged = _buf("breaking", "proto", "--against", str(ROOT / "proto"))
    assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr


def _make_proto_check(*args: str) -> subprocess.CompletedProcess[str]:
    _buf_binary()  # skips when buf cannot run
    if shutil.which("make") is None:
        pytest.skip("no make")
    # -o: treat the venv stamp as up to date, so make never reinstalls the venv here.
    cmd = ["make", "--no-print-directory", "-o", ".venv/.installed", "proto-check", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_proto_check_without_the_branch_skips_breaking() -> None:
    result = _make_proto_check("PROTO_AGAINST=no-such-branch-for-tokenline-tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "buf breaking skipped" in result.stdout


def test_proto_check_against_main() -> None:
    """The working tree is wire-compatible with main (trivially so in a clean checkout)."""
    has_main = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", "main^{commit}"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if has_main.returncode != 0:
        pytest.skip("no main branch in this checkout")
    result = _make_proto_check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "buf breaking proto --against '.git#branch=main,subdir=proto'" in result.stdout
