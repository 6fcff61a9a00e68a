"""``DecodeStatus``: what the manager holds per live request, whatever the engine.

Owns the request's routing and stop options and the committed text not sent
yet, and the hold-back of a tail that could still start a stop string. How ids
become committed text is the engine's: byte_engine.py and window_engine.py each
implement this interface, and incremental.py chooses between them.

Each step is two calls, and between them the manager decodes what every
request asked for in one batched call per flag group: ``add_ids`` returns the
id sequences to decode, then ``stream_delta`` (or, on the final row,
``final_remainder``) takes their texts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from services.detokenizer.stop_strings import stop_prefix_overlap
from services.detokenizer.text_decoder import DecodeFlags, TextDecoder


@dataclass(slots=True, kw_only=True)
class DecodeStatus(ABC):
    """One request's incremental decode: every delta extends what was sent, and all
    of them together are the full decode of the output ids (stop string trimmed)."""

    flags: DecodeFlags
    reply_to: str  # the frontend that owns the request
    source: str = ""  # the scheduler stream that created this state
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    pending: str = ""  # committed output text not sent yet

    @abstractmethod
    def add_ids(
        self, new_ids: list[int], decoder: TextDecoder, *, final: bool
    ) -> tuple[list[int], ...]:
        """Take one step's ids (``final`` on the request's last row, once).

        Returns the id sequences whose decode (with ``self.flags``) the next call,
        ``stream_delta`` or ``final_remainder``, needs, in this order; often none.
        """

    @abstractmethod
    def stream_delta(self, texts: Sequence[str], decoder: TextDecoder) -> str:
        """Commit this step's text (``texts``: the decode of ``add_ids``' sequences) and
        take the delta that may be sent now: it never ends in a stop string's prefix."""

    @abstractmethod
    def final_remainder(self, texts: Sequence[str], decoder: TextDecoder) -> tuple[str, bool]:
        """After ``add_ids(final=True)``: the output text not sent yet, as the full decode
        ends it (no stop trimmed), and whether that decode extends what was sent.

        False means the tokenizer's decode is not local enough for incremental decoding;
        the remainder is then the full decode past the length that was sent.
        """

    def take_delta(self) -> str:
        """Send the pending text, holding back a tail that could start a stop string.

        Sent text never ends in a proper prefix of a stop string, so looking at
        the pending text alone finds the whole held tail.
        """
        text = self.pending
        end = len(text)
        if self.stop and not self.no_stop_trim:
            end -= stop_prefix_overlap(text, self.stop)
        if end <= 0:
            return ""
        delta, self.pending = text[:end], text[end:]
        return delta
