"""The shape of the code stays as issue #34 left it: no folder under services/ or gateway/
holds more than 20 modules directly, and the import contracts `make lint` runs (pyproject's
[tool.importlinter]) see imports under ``if TYPE_CHECKING:``, so no cycle hides there."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_MODULES_PER_FOLDER = 20


def modules_per_folder(root: Path) -> dict[Path, int]:
    """Each package folder under ``root`` (itself included) -> its own ``.py`` files."""
    folders = [root, *(p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    return {folder: len(list(folder.glob("*.py"))) for folder in folders}


def test_no_folder_holds_more_than_20_modules() -> None:
    counts = {
        **modules_per_folder(REPO_ROOT / "services"),
        **modules_per_folder(REPO_ROOT / "gateway"),
    }
    crowded = {
        str(p.relative_to(REPO_ROOT)): n for p, n in counts.items() if n > MAX_MODULES_PER_FOLDER
    }
    assert not crowded, (
        f"split these by concern (at most {MAX_MODULES_PER_FOLDER} modules each): {crowded}"
    )
    assert counts[REPO_ROOT / "services" / "scheduler" / "core"] > 0  # the walk saw the tree


def _probe_config(probe_root: Path) -> Path:
    """An import-linter config for the probe package with pyproject's own options (all but
    its roots and contracts), so an option that drops TYPE_CHECKING imports shows here."""
    options = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = ["[tool.importlinter]", 'root_packages = ["probe"]']
    lines += [
        f"{key} = {value!r}".replace("True", "true").replace("False", "false")
        for key, value in options.items()
        if key not in ("root_packages", "contracts")
    ]
    lines += [
        "",
        "[[tool.importlinter.contracts]]",
        'name = "probe acyclic"',
        'type = "acyclic_siblings"',
        'ancestors = ["probe"]',
    ]
    config = probe_root / "probe.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def _lint_probe(probe_root: Path) -> subprocess.CompletedProcess[str]:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(lint_imports), "--config", str(_probe_config(probe_root))],
        cwd=probe_root,
        env={"PYTHONPATH": str(probe_root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.tooling
def test_import_contracts_see_a_cycle_closed_only_under_type_checking(tmp_path: Path) -> None:
    package = tmp_path / "probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "req.py").write_text("from probe import cache\n")
    (package / "cache.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from probe import req\n"
    )
    broken = _lint_probe(tmp_path)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "probe acyclic BROKEN" in broken.stdout
    (package / "cache.py").write_text("")  # the same probe without the hidden import passes
    kept = _lint_probe(tmp_path)
    assert kept.returncode == 0, kept.stdout + kept.stderr
