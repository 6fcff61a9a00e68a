"""The streamed string cleanup equals transformers' cleanup of the whole text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from services.detokenizer.cleanup import STANDARD_PATTERN_CHARS, Cleanup


def clean(text: str) -> str:
    return PreTrainedTokenizerBase.clean_up_tokenization(None, text)  # type: ignore[arg-type]


CLEANUP = Cleanup(apply=clean, pattern_chars=STANDARD_PATTERN_CHARS)
# Pattern characters dominate, so patterns form and straddle every cut.
TEXT = st.text(alphabet=st.sampled_from(" .?!,'ntmsverdoa你"), max_size=30)


@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(TEXT, max_size=8))
def test_cleaning_up_to_each_safe_cut_equals_cleaning_the_whole(pieces: list[str]) -> None:
    out, pending = "", ""
    for piece in pieces:
        pending += piece
        cut = CLEANUP.safe_cut(pending)
        out += clean(pending[:cut])
        pending = pending[cut:]
    assert out + clean(pending) == clean("".join(pieces))


def test_safe_cut_is_after_the_last_character_outside_the_patterns() -> None:
    assert CLEANUP.safe_cut("it ' s") == 1  # after "i"
    assert CLEANUP.safe_cut("t ' s") == 0
    assert CLEANUP.safe_cut("ok it '") == 4  # "i" is the last character in no pattern
    assert CLEANUP.safe_cut("hello world ") == 11
    assert Cleanup(apply=clean, pattern_chars=None).safe_cut("hello") == 0
