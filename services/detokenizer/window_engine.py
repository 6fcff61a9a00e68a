"""The window engine: incremental decoding for every decoder that is not ByteLevel.

Owns the request's ids (a prompt tail as context, then the output), the
offsets into them, the raw text a string cleanup has not finalised, and what
was sent (for the final check).

Per step the window ``ids[surr:end]`` is decoded, where ``surr`` is the last
visible token before ``read`` (its text, decoded alone and cached, is the
context) and ``end`` leaves out an open byte-fallback run. The text after the
context is committed only if it does not end in U+FFFD (an incomplete
character); otherwise the offsets stay and the next step tries again. String
cleanup, when the tokenizer applies one, runs on committed text up to the last
cut where it is final (cleanup.py). At finish the whole output is decoded once
and becomes the final text, so an open run, a pending U+FFFD or a held cleanup
tail ends exactly as the full decode ends; the manager checks that what was
sent is a prefix of it.

The prompt tail that seeds the window is first cut back to a point whose text is
final (no open run, no trailing U+FFFD), so no prompt character can change and
none is ever counted as output. When that cut leaves no visible token although
the tail had one (a tail that is all one byte run: CJK or emoji text on a
byte-fallback vocabulary), the decoder's stand-in word piece is the context
instead; with none, the output would decode as the start of the text, and
SentencePiece decoders strip a leading space there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.detokenizer.decode_status import DecodeStatus
from services.detokenizer.text_decoder import DecodeFlags, TextDecoder

REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True, kw_only=True)
class WindowDecodeStatus(DecodeStatus):
    """A request decoded through windows of its ids; build it with ``create``."""

    ids: list[int]  # the prompt tail kept as context, then the output ids
    num_context_ids: int  # leading ids that came from the prompt
    surr_offset: int  # tokens: the visible token left of read_offset (its text is context)
    read_offset: int  # tokens: the text of everything before this is committed
    window_end: int = 0  # tokens: the end of the window add_ids handed out this step
    raw_tail: str = ""  # committed raw text after the last cleanup cut
    sent: list[str] = field(default_factory=list)  # the deltas sent, for the final check

    @classmethod
    def create(
        cls, prompt_tail: list[int], decoder: TextDecoder, flags: DecodeFlags, **fields: Any
    ) -> WindowDecodeStatus:
        """A new request's state; ``fields`` are ``DecodeStatus``'s (reply_to, stop...)."""
        context = window_context(prompt_tail, decoder, flags)
        surr = last_visible(context, 0, len(context), decoder, flags)
        return cls(
            ids=context,
            num_context_ids=len(context),
            surr_offset=len(context) if surr is None else surr,
            read_offset=len(context),
            flags=flags,
            **fields,
        )

    def add_ids(
        self, new_ids: list[int], decoder: TextDecoder, *, final: bool
    ) -> tuple[list[int], ...]:
        """Streaming: this step's window, or none when no new text can be final yet.
        Final: all ids and the context, whose decodes give the final text."""
        self.ids.extend(new_ids)
        if final:
            return self.ids, self.ids[: self.num_context_ids]
        self.window_end = decoder.stable_end(self.ids, self.read_offset, self.flags)
        if self.window_end <= self.read_offset:
            return ()
        return (self.ids[self.surr_offset : self.window_end],)

    def stream_delta(self, texts: Sequence[str], decoder: TextDecoder) -> str:
        if texts:
            self._commit(texts[0], decoder)
        delta = self.take_delta()
        if delta:
            self.sent.append(delta)
        return delta

    def final_remainder(self, texts: Sequence[str], decoder: TextDecoder) -> tuple[str, bool]:
        full, context = texts
        # The context's text is final by construction, so it is a prefix of ``full``.
        raw = full[len(context) :]
        text = decoder.cleanup.apply(raw) if decoder.cleanup else raw
        sent = "".join(self.sent)
        return text[len(sent) :], text.startswith(sent)

    def _commit(self, window_text: str, decoder: TextDecoder) -> None:
        """Commit the window's new text, unless it is not final yet (or not consistent)."""
        context = self._context_text(decoder)
        if not window_text.startswith(context):
            return
        new_text = window_text[len(context) :]
        if new_text.endswith(REPLACEMENT_CHAR):
            return
        self._append(new_text, decoder)
        last = last_visible(self.ids, self.read_offset, self.window_end, decoder, self.flags)
        if last is not None:
            self.surr_offset = last
        self.read_offset = self.window_end

    def _context_text(self, decoder: TextDecoder) -> str:
        if self.surr_offset >= self.read_offset:
            return ""
        return decoder.token_text(self.ids[self.surr_offset], self.flags)

    def _append(self, raw: str, decoder: TextDecoder) -> None:
        cleanup = decoder.cleanup
        if cleanup is None:
            self.pending += raw
            return
        raw = self.raw_tail + raw
        cut = cleanup.safe_cut(raw)
        self.pending += cleanup.apply(raw[:cut])
        self.raw_tail = raw[cut:]


def window_context(prompt_tail: list[int], decoder: TextDecoder, flags: DecodeFlags) -> list[int]:
    """The prompt ids that seed the window: ``final_context``, or the stand-in when that
    shows no token although the tail does (the output does not start the text)."""
    context = final_context(prompt_tail, decoder, flags)
    if decoder.stand_in_id is None or _has_visible(context, decoder, flags):
        return context
    if not _has_visible(prompt_tail, decoder, flags):
        return context  # the output really is the start of the (tail's) text
    return [*context, decoder.stand_in_id]


def _has_visible(ids: list[int], decoder: TextDecoder, flags: DecodeFlags) -> bool:
    return last_visible(ids, 0, len(ids), decoder, flags) is not None


def final_context(prompt_tail: list[int], decoder: TextDecoder, flags: DecodeFlags) -> list[int]:
    """The longest prefix of ``prompt_tail`` whose text no later token can change."""
    end = decoder.stable_end(prompt_tail, 0, flags)
    while end > 0 and decoder.decode_batch([prompt_tail[:end]], flags)[0].endswith(
        REPLACEMENT_CHAR
    ):
        end -= 1
    return list(prompt_tail[:end])


def last_visible(
    ids: list[int], start: int, end: int, decoder: TextDecoder, flags: DecodeFlags
) -> int | None:
    """Index of the last token in ``ids[start:end]`` that the decode does not skip."""
    for i in range(end - 1, start - 1, -1):
        if decoder.is_visible(ids[i], flags):
            return i
    return None
