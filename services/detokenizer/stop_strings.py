"""Stop strings on the detokenizer's side: hold back what could still become one,
cut the final text at the first one."""

from __future__ import annotations

from collections.abc import Sequence


def stop_prefix_overlap(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

    That suffix is held back while streaming: it is released once more text
    shows it cannot start a stop, or at finish. A whole stop string is not held:
    the scheduler finishes on it in the same row, and before ``min_tokens`` it
    is ordinary text.
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def first_stop_at(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index of the earliest occurrence of any stop string at or after ``start``."""
    found = [pos for stop in stops if stop and (pos := text.find(stop, start)) >= 0]
    return min(found) if found else None
