"""The README's metric table is the list operators read: it must name every metric the
services register, with the right type, and nothing they do not."""

from __future__ import annotations

import re

from tests.metric_names import ROOT, family_names

ROW = re.compile(r"^\| `(tokenline[\w:]+)` \| (\w+) \|", re.MULTILINE)


def readme_metrics() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Observability", 1)[1].split("\n## ", 1)[0]
    return dict(ROW.findall(section))


def test_readme_table_matches_the_registered_metrics() -> None:
    documented, registered = readme_metrics(), family_names()
    assert sorted(set(registered) - set(documented)) == [], "registered but not in the README"
    assert sorted(set(documented) - set(registered)) == [], "in the README but not registered"
    wrong = {n: (documented[n], t) for n, t in registered.items() if documented[n] != t}
    assert wrong == {}, "README type differs from the registered type"
