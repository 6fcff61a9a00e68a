"""docs/flags.md is what the parsers say: regenerated here and compared, so a flag added,
renamed or given a new default without `make docs` fails the suite."""

from __future__ import annotations

import os

import pytest

from services.common import flags_doc

pytestmark = pytest.mark.tooling


def test_flags_md_is_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regenerated under a set TOKENLINE_PORT, which must not leak into the defaults."""
    monkeypatch.setenv("TOKENLINE_PORT", "9999")
    assert flags_doc.FLAGS_MD.read_text() == flags_doc.render(), (
        "docs/flags.md is stale: run `make docs`"
    )
    assert os.environ["TOKENLINE_PORT"] == "9999"


def test_every_command_and_flag_is_in_the_reference() -> None:
    text = flags_doc.FLAGS_MD.read_text()
    for command in flags_doc.COMMANDS:
        assert f"\n## {command.title}\n" in text
        for action in flags_doc.documented_actions(command.create_parser()):
            assert flags_doc.table_cell(flags_doc.flag_cell(action)) in text, (
                command.title,
                action.dest,
            )


def test_environment_column_names_only_real_fallbacks() -> None:
    """--multiplex reads TOKENLINE_MULTIPLEX; launch's --host reads no variable, though
    TOKENLINE_HOST exists (the services' --host reads it)."""
    gateway, launch = (c for c in flags_doc.COMMANDS if c.title in ("gateway", "serve"))
    assert flags_doc.env_fallbacks(gateway, gateway.create_parser())["multiplex"] == (
        "TOKENLINE_MULTIPLEX"
    )
    assert "host" not in flags_doc.env_fallbacks(launch, launch.create_parser())


def test_check_fails_on_a_stale_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    current = flags_doc.FLAGS_MD.read_text()  # what render() gives: the first test says so
    stale = tmp_path / "flags.md"
    stale.write_text(current.replace("`50052`", "`50099`"))
    monkeypatch.setattr(flags_doc, "render", lambda: current)
    monkeypatch.setattr(flags_doc, "FLAGS_MD", stale)
    monkeypatch.setattr(flags_doc, "ROOT", tmp_path)
    assert flags_doc.main(["--check"]) == 1
    assert flags_doc.main(["--write"]) == 0
    assert flags_doc.main(["--check"]) == 0
    assert stale.read_text() == current
