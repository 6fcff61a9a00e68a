"""Session-wide tokenizer families for the detokenizer tests (loading them takes seconds)."""

from __future__ import annotations

import pytest

from tests.detokenizer.families import (
    Family,
    bytelevel_family,
    sentencepiece_family,
    wordpiece_family,
)


@pytest.fixture(scope="session")
def bytelevel() -> Family:
    return bytelevel_family()


@pytest.fixture(scope="session")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return sentencepiece_family(tmp_path_factory.mktemp("sentencepiece"))


@pytest.fixture(scope="session")
def wordpiece() -> Family:
    return wordpiece_family()


@pytest.fixture(scope="session")
def wordpiece_cleanup() -> Family:
    return wordpiece_family(cleanup=True)


@pytest.fixture(scope="session", params=["bytelevel", "sentencepiece", "wordpiece"])
def family(request: pytest.FixtureRequest) -> Family:
    """Each of the three families in turn."""
    return request.getfixturevalue(request.param)
