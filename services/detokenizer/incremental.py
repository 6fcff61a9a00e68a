"""Incremental detokenization: stable text deltas from a growing id list.

Owns the choice of engine. Each live request keeps a ``DecodeStatus``
(decode_status.py). The text it may send is always a prefix of what a full
decode of the same ids will give, however the request continues, so
concatenated deltas equal the full decode and nothing is ever sent twice or
taken back. Two engines, chosen per tokenizer (text_decoder.py):

* the byte engine (byte_engine.py), for ByteLevel tokenizers: each token's
  bytes through an incremental UTF-8 decoder; no decode call at all;
* the window engine (window_engine.py), for every other decoder: a batched
  decode of a window of ids per step, committed once its text is final.
"""

from __future__ import annotations

from services.detokenizer.byte_engine import ByteDecodeStatus
from services.detokenizer.decode_status import DecodeStatus
from services.detokenizer.text_decoder import DecodeFlags, TextDecoder
from services.detokenizer.window_engine import WindowDecodeStatus


def create_decode_status(
    prompt_tail: list[int],
    decoder: TextDecoder,
    flags: DecodeFlags,
    *,
    reply_to: str,
    source: str = "",
    stop: tuple[str, ...] = (),
    no_stop_trim: bool = False,
) -> DecodeStatus:
    """A new request's state on ``decoder``'s engine; ``prompt_tail`` ends the prompt."""
    if decoder.token_bytes is not None:
        # Bytes then lossy UTF-8: a closed prompt leaves nothing to carry over.
        return ByteDecodeStatus(
            flags=flags, reply_to=reply_to, source=source, stop=stop, no_stop_trim=no_stop_trim
        )
    return WindowDecodeStatus.create(
        prompt_tail,
        decoder,
        flags,
        reply_to=reply_to,
        source=source,
        stop=stop,
        no_stop_trim=no_stop_trim,
    )
