"""Hypothesis strategies for the id sequences that stress each tokenizer family
(the families themselves: bench/tokenizer_families.py)."""

from __future__ import annotations

from hypothesis import strategies as st

from bench.tokenizer_families import (
    CHARS,
    TORTURE,
    WORDS,
    Family,
    bytelevel_family,
    sentencepiece_family,
    train_sentencepiece,
    wordpiece_family,
)

__all__ = [
    "CHARS",
    "TORTURE",
    "WORDS",
    "Family",
    "bytelevel_family",
    "chunk",
    "chunkings",
    "id_sequences",
    "sentencepiece_family",
    "texts",
    "train_sentencepiece",
    "wordpiece_family",
]


def texts(max_size: int = 24) -> st.SearchStrategy[str]:
    return st.text(alphabet=st.sampled_from(CHARS), max_size=max_size)


@st.composite
def id_sequences(draw: st.DrawFn, family: Family, max_segments: int = 6) -> list[int]:
    """Valid and adversarial ids: encoded text, random vocabulary ids, UTF-8 bytes of
    multi-byte characters cut at random points, and special tokens, concatenated."""
    segments = draw(st.lists(_segment(family), min_size=1, max_size=max_segments))
    return [i for seg in segments for i in seg][:48]


def _segment(family: Family) -> st.SearchStrategy[list[int]]:
    options = [
        texts().map(family.encode),
        st.lists(st.integers(0, family.vocab_size - 1), min_size=1, max_size=6),
        st.lists(st.sampled_from(family.added_ids), min_size=1, max_size=2),
    ]
    if family.byte_token_ids:
        options.append(_split_characters(family))
    return st.one_of(options)


@st.composite
def _split_characters(draw: st.DrawFn, family: Family) -> list[int]:
    """Byte tokens of multi-byte text with bytes dropped at both ends (split characters)."""
    data = draw(texts(max_size=4).filter(bool)).encode()
    start = draw(st.integers(0, min(3, len(data) - 1)))
    end = draw(st.integers(start + 1, len(data)))
    return [family.byte_token_ids[b] for b in data[start:end]]


def chunkings(max_cuts: int = 12) -> st.SearchStrategy[list[int]]:
    """Cut points; ``chunk`` maps them onto an id list of any length."""
    return st.lists(st.integers(0, 10_000), max_size=max_cuts)


def chunk(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [[]]
