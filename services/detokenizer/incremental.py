"""Incremental detokenization: stable text deltas from a growing id list.

Each live request keeps a ``DecodeStatus``. Per step, the window
``ids[surr:read]`` (already emitted tokens, for context) and ``ids[surr:]``
are decoded; the difference is the new text. When it ends in U+FFFD a
multi-byte character is still incomplete: offsets stay put and only the
printable part before it is offered, tentatively.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DecodeStatus:
    decode_ids: list[int]
    surr_offset: int  # tokens: start of the context window
    read_offset: int  # tokens: everything before this is committed text
    decoded_text: str = ""  # committed text (excludes the prompt tail)
    sent_offset: int = 0  # characters of output text already emitted
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop: list[str] = field(default_factory=list)
    reply_to: str = ""
    num_output_tokens: int = 0

    @classmethod
    def create(cls, prompt_tail_ids: list[int], **flags: object) -> DecodeStatus:
        return cls(
            decode_ids=list(prompt_tail_ids),
            surr_offset=0,
            read_offset=len(prompt_tail_ids),
            **flags,  # type: ignore[arg-type]
        )

    @property
    def group_key(self) -> tuple[bool, bool]:
        """Requests decode together only when their flags agree."""
        return (self.skip_special_tokens, self.spaces_between_special_tokens)

    def windows(self) -> tuple[list[int], list[int]]:
        ids = self.decode_ids
        return ids[self.surr_offset : self.read_offset], ids[self.surr_offset :]

    def advance(self, surr_text: str, full_text: str, *, final: bool = False) -> str:
        """Commit what is stable; return the text visible now (committed + tentative).

        At ``final`` everything is committed, a dangling U+FFFD included, so the
        stream ends exactly where a full decode of the same ids ends.
        """
        new_text = full_text[len(surr_text) :]
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return self.decoded_text + printable_prefix(new_text)
        self.decoded_text += new_text
        self.surr_offset = self.read_offset
        self.read_offset = len(self.decode_ids)
        return self.decoded_text

    def take_delta(self, visible: str, *, final: bool) -> str:
        """Emit visible[sent_offset:], holding back a tail that could start a stop string."""
        end = len(visible) if final else len(visible) - stop_prefix_overlap(visible, self.stop)
        if end <= self.sent_offset:
            return ""
        delta = visible[self.sent_offset : end]
        self.sent_offset = end
        return delta


def printable_prefix(text: str) -> str:
    """The part of ``text`` before its trailing run of U+FFFD."""
    return text.rstrip(REPLACEMENT_CHAR)


def stop_prefix_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

    A whole stop string is not held: the scheduler finishes on it in the same row,
    and before ``min_tokens`` it is ordinary text.
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def trim_stop(text: str, matched: str | None, start: int) -> str:
    """Cut ``text`` at the first occurrence of ``matched`` at or after ``start``."""
    if not matched:
        return text
    pos = text.find(matched, start)
    return text if pos < 0 else text[:pos]
