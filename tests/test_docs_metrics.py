"""The metric table of docs/observability.md is the list operators read: it must name every
metric the services register, with the right type, and nothing they do not."""

from __future__ import annotations

import re

from tests.metric_names import ROOT, family_names

ROW = re.compile(r"^\| `(tokenline[\w:]+)` \| (\w+) \|", re.MULTILINE)


def documented_metrics() -> dict[str, str]:
    text = (ROOT / "docs" / "observability.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    return dict(ROW.findall(section))


def test_metric_table_matches_the_registered_metrics() -> None:
    documented, registered = documented_metrics(), family_names()
    assert sorted(set(registered) - set(documented)) == [], "registered but not in the docs"
    assert sorted(set(documented) - set(registered)) == [], "in the docs but not registered"
    wrong = {n: (documented[n], t) for n, t in registered.items() if documented[n] != t}
    assert wrong == {}, "documented type differs from the registered type"
