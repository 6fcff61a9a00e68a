"""The README stays a front page and the docs stay linked: its first screen shows the two
commands, CI runs exactly its test command, and every relative link in README.md and
docs/ reaches a file and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.tooling

# Documents other branches add (docs/models.md, docs/model-impl.md); remove once merged.
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+ (.*)$", re.MULTILINE)
FENCE = re.compile(r"```.*?```", re.DOTALL)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(h) for h in HEADING.findall(FENCE.sub("", path.read_text()))}


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    first_screen = "\n".join(lines[:60])
    assert "make run" in first_screen and "make test" in first_screen


def test_ci_runs_exactly_the_readme_test_command() -> None:
    commands = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd ", "echo "))
    ]
    assert commands == ["make test"]


def test_every_relative_link_resolves() -> None:
    broken = []
    for doc in documents():
        for link in LINK.findall(doc.read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, fragment = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists() or (fragment and fragment not in anchors(target)):
                broken.append(f"{doc.relative_to(ROOT)}: {link}")
    assert broken == []


def test_the_checker_sees_a_broken_anchor(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text("# A title, with `code`\n\n## The cost: `python -m bench.split`\n")
    assert anchors(doc) == {"a-title-with-code", "the-cost-python--m-benchsplit"}
