"""transformers' ``clean_up_tokenization_spaces``, applied to a growing text.

The cleanup is a chain of ``str.replace`` calls whose patterns only ever delete
spaces ("it ' s" -> "it's", "a ." -> "a."). It is not prefix-stable: the text
"it '" changes once "s" follows. It does split exactly, though, after any
character that occurs in none of the patterns: no occurrence can span such a
character (it is never deleted and cannot be part of one), so
``clean(a + b) == clean(a) + clean(b)`` whenever ``a`` ends with it. Cleaning
each piece up to the last such cut gives the same text as cleaning the whole,
while the piece after the cut waits for more text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# The probe decodes to text that the standard cleanup changes ("x ' s ." -> "x's.").
_PROBE_TEXT = "x ' s ."
# Characters of the standard patterns: " .", " ?", " !", " ,", " ' ", " n't", " 'm",
# " 's", " 've", " 're" (tests/detokenizer/test_cleanup.py checks the split property).
STANDARD_PATTERN_CHARS = frozenset(" .?!,'ntmsver")


@dataclass(frozen=True, slots=True)
class Cleanup:
    """The tokenizer's cleanup function and the characters that appear in its patterns.

    ``pattern_chars`` None means the patterns are unknown (an overridden cleanup):
    no cut is safe before the text is final.
    """

    apply: Callable[[str], str]
    pattern_chars: frozenset[str] | None

    def safe_cut(self, text: str) -> int:
        """Length of the longest prefix of ``text`` whose cleanup can never change."""
        if self.pattern_chars is None:
            return 0
        for i in range(len(text), 0, -1):
            if text[i - 1] not in self.pattern_chars:
                return i
        return 0


def create_cleanup(tokenizer: Any) -> Cleanup | None:
    """The cleanup ``tokenizer.decode`` applies by default, or None when it applies none.

    Asked of the tokenizer itself (transformers skips the cleanup for BPE models
    whatever the config says), by decoding a probe with and without it.
    """
    clean = getattr(tokenizer, "clean_up_tokenization", None)
    if clean is None:
        return None
    ids = tokenizer.encode(_PROBE_TEXT, add_special_tokens=False)
    raw = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    if clean(raw) == raw or tokenizer.decode(ids) != clean(raw):
        return None
    is_standard = getattr(type(tokenizer), "clean_up_tokenization", None) is getattr(
        PreTrainedTokenizerBase, "clean_up_tokenization", None
    )
    if not is_standard:
        logger.warning("custom clean_up_tokenization: its text is held until each request ends")
    return Cleanup(apply=clean, pattern_chars=STANDARD_PATTERN_CHARS if is_standard else None)
