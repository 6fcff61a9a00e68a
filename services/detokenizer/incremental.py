"""Incremental detokenization: stable text deltas from a growing id list.

Each live request keeps a ``DecodeStatus``. The text it may send is always a
prefix of what a full decode of the same ids will give, however the request
continues, so concatenated deltas equal the full decode and nothing is ever
sent twice or taken back. Two engines, chosen per tokenizer (text_decoder.py):

* Byte engine, for ByteLevel tokenizers (GPT-2 style BPE: DeepSeek, Llama 3,
  Qwen): their decode is "join each token's bytes, then lossy UTF-8", so each
  token's bytes go through CPython's UTF-8 decoder, which holds back an
  incomplete character. Exact by construction; no decode call at all.
* Window engine, for every other decoder: per step the window
  ``ids[surr:end]`` is decoded, where ``surr`` is the last visible token before
  ``read`` (its text, decoded alone and cached, is the context) and ``end``
  leaves out an open byte-fallback run. The text after the context is
  committed only if it does not end in U+FFFD (an incomplete character);
  otherwise the offsets stay and the next step tries again. String cleanup,
  when the tokenizer applies one, runs on committed text up to the last cut
  where it is final (cleanup.py). At finish the whole output is decoded once
  and becomes the final text, so an open run, a pending U+FFFD or a held
  cleanup tail ends exactly as the full decode ends; the manager checks that
  what was sent is a prefix of it.

The prompt tail that seeds the window is first cut back to a point whose text is
final (no open run, no trailing U+FFFD), so no prompt character can change and
none is ever counted as output. When that cut leaves no visible token although
the tail had one (a tail that is all one byte run: CJK or emoji text on a
byte-fallback vocabulary), the decoder's stand-in word piece is the context
instead; with none, the output would decode as the start of the text, and
SentencePiece decoders strip a leading space there. The byte engine needs no
context at all.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from services.detokenizer.stop_strings import stop_prefix_overlap
from services.detokenizer.text_decoder import DecodeFlags, TextDecoder

REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DecodeStatus:
    ids: list[int]  # window engine: the prompt tail kept as context, then the output ids
    num_context_ids: int  # leading ids that came from the prompt
    surr_offset: int  # tokens: the visible token left of read_offset (its text is context)
    read_offset: int  # tokens: the text of everything before this is committed
    flags: DecodeFlags
    reply_to: str
    source: str = ""  # the scheduler stream that created this state
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    pending: str = ""  # committed output text not sent yet (cleanup applied)
    raw_tail: str = ""  # committed raw text after the last cleanup cut
    sent_offset: int = 0  # characters of output text already sent
    sent: list[str] = field(default_factory=list)  # window engine: deltas, for the final check
    # Byte engine (ByteLevel tokenizers): bytes of an incomplete character; None selects
    # the window engine, which uses ids and the offsets instead.
    undecoded: bytes | None = None

    @classmethod
    def create(
        cls, prompt_tail: list[int], decoder: TextDecoder, flags: DecodeFlags, **fields: object
    ) -> DecodeStatus:
        if decoder.token_bytes is not None:
            # Bytes then lossy UTF-8: a closed context leaves nothing to carry over.
            context, fields["undecoded"] = [], b""
        else:
            context = window_context(prompt_tail, decoder, flags)
        surr = last_visible(context, 0, len(context), decoder, flags)
        return cls(
            ids=context,
            num_context_ids=len(context),
            surr_offset=len(context) if surr is None else surr,
            read_offset=len(context),
            flags=flags,
            **fields,  # type: ignore[arg-type]
        )

    def feed(self, new_ids: list[int], decoder: TextDecoder, *, final: bool) -> None:
        """Byte engine: commit the text of ``new_ids``; an incomplete character waits.

        CPython's UTF-8 decoder replaces invalid bytes as Rust's ``from_utf8_lossy``
        does (one U+FFFD per maximal invalid subpart), and with ``final`` False it
        leaves an incomplete trailing sequence unconsumed.
        """
        data = decoder.bytes_of(new_ids, self.flags)
        if self.undecoded:
            data = self.undecoded + data
        text, used = codecs.utf_8_decode(data, "replace", final)
        self.undecoded = data[used:]
        self.pending += text

    def stream_window(self, decoder: TextDecoder) -> tuple[int, list[int]] | None:
        """``(end, ids)`` to decode this step, or None when no new text can be final yet."""
        end = decoder.stable_end(self.ids, self.read_offset, self.flags)
        if end <= self.read_offset:
            return None
        return end, self.ids[self.surr_offset : end]

    def commit(self, end: int, window_text: str, decoder: TextDecoder) -> bool:
        """Commit the window's new text; False when it is not final yet (or not consistent)."""
        context = self._context_text(decoder)
        if not window_text.startswith(context):
            return False
        new_text = window_text[len(context) :]
        if new_text.endswith(REPLACEMENT_CHAR):
            return False
        self._append(new_text, decoder)
        last = last_visible(self.ids, self.read_offset, end, decoder, self.flags)
        if last is not None:
            self.surr_offset = last
        self.read_offset = end
        return True

    def final_windows(self) -> list[list[int]]:
        """The two sequences whose decode gives the final text: all ids, and the context."""
        return [self.ids, self.ids[: self.num_context_ids]]

    def final_text(self, full: str, context: str, decoder: TextDecoder) -> str:
        """The whole output text from the decode of ``final_windows()``."""
        # The context's text is final by construction, so it is a prefix of ``full``.
        raw = full[len(context) :]
        return decoder.cleanup.apply(raw) if decoder.cleanup else raw

    def sent_text(self) -> str:
        return "".join(self.sent)

    def take_delta(self, *, final: bool) -> str:
        """Send the pending text, holding back a tail that could start a stop string.

        Sent text never ends in a proper prefix of a stop string, so looking at
        the pending text alone finds the whole held tail.
        """
        text = self.pending
        end = len(text)
        if not final and self.stop and not self.no_stop_trim:
            end -= stop_prefix_overlap(text, self.stop)
        if end <= 0:
            return ""
        delta, self.pending = text[:end], text[end:]
        self.sent_offset += end
        if self.undecoded is None:
            self.sent.append(delta)
        return delta

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
