"""The byte engine: incremental decoding for ByteLevel tokenizers, with no decode call.

Owns the bytes of an incomplete character. A ByteLevel decode (GPT-2 style
BPE: DeepSeek, Llama 3, Qwen) is "join each token's bytes, then lossy UTF-8",
so each token's bytes (text_decoder.py's table) go through CPython's UTF-8
decoder, which holds back an incomplete character. Exact by construction, and
the prompt gives no context: its decode is closed before the output starts.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from services.detokenizer.decode_status import DecodeStatus
from services.detokenizer.text_decoder import TextDecoder


@dataclass(slots=True, kw_only=True)
class ByteDecodeStatus(DecodeStatus):
    """A request on a ByteLevel tokenizer: it never asks for a decode."""

    undecoded: bytes = b""  # the bytes of an incomplete character

    def add_ids(
        self, new_ids: list[int], decoder: TextDecoder, *, final: bool
    ) -> tuple[list[int], ...]:
        """Commit the text of ``new_ids``; an incomplete character waits unless ``final``.

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
        return ()

    def stream_delta(self, texts: Sequence[str], decoder: TextDecoder) -> str:
        return self.take_delta()

    def final_remainder(self, texts: Sequence[str], decoder: TextDecoder) -> tuple[str, bool]:
        return self.pending, True  # exact: the final add_ids flushed the last bytes
