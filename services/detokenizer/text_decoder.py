"""The tokenizer's decode, as the detokenizer needs it.

``TextDecoder`` wraps a Hugging Face tokenizer and answers two questions:
what text do these ids decode to (raw, batched, per flag group), and where in
an id list does the text stop being final. For a ByteLevel decoder it also
holds each token's bytes, so the byte engine (incremental.py) needs no decode
call. The stability answers come from facts about the decoder read once at start:

* ByteFallback decoders (SentencePiece ``<0xXX>`` pieces) turn a whole run of
  byte pieces into characters only if the entire run is valid UTF-8, and into
  one U+FFFD per byte otherwise; a run's text is final only once a non-byte
  token ends it.
* Skipped special tokens are invisible to the decoder, so they neither end a
  run nor give a later token its left context.
* transformers' ``clean_up_tokenization_spaces`` rewrites the decoded string
  after the fact; it is applied here, outside the raw decode (see cleanup.py).

Everything else a decoder does (ByteLevel's lossy UTF-8, Metaspace and
WordPiece first-token rules, Strip of a leading space) depends on at most the
one token to the left, which the incremental windows always include. Where the
prompt's real left neighbour has to be dropped, a stand-in word piece takes its
place, so the output is never decoded as the start of the text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.detokenizer.cleanup import Cleanup, create_cleanup

logger = logging.getLogger(__name__)

_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_STAND_IN_BATCH = 256  # single-token decodes per call while looking for a stand-in


@dataclass(frozen=True, slots=True)
class DecodeFlags:
    """Per-request decode options; requests share a decode call only when these agree."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class TextDecoder:
    """Batched raw decoding plus the stability facts of one tokenizer.

    Thread-compatible, not thread-safe (the single-token cache is a plain dict).
    """

    def __init__(self, tokenizer: Any, *, use_byte_engine: bool = True) -> None:
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.special_ids: frozenset[int] = self._special_ids()
        self.byte_ids: frozenset[int] = self._byte_fallback_ids()
        self.cleanup: Cleanup | None = create_cleanup(tokenizer)
        # ByteLevel tokenizers decode through a byte table (exact and fastest);
        # every other decoder through windows. False forces windows (tests, bench).
        self.token_bytes = self._byte_level_table() if use_byte_engine else None
        # The window engine's left neighbour for output whose real one was dropped.
        self.stand_in_id = self._stand_in_id() if self.token_bytes is None else None
        self._token_text: dict[DecodeFlags, dict[int, str]] = {}
        if self.backend is None:
            logger.warning(
                "tokenizer %s has no fast backend; incremental decoding assumes its decode "
                "only looks one token to the left",
                type(tokenizer).__name__,
            )

    @property
    def is_fast(self) -> bool:
        return self.backend is not None

    def decode_batch(self, seqs: Sequence[list[int]], flags: DecodeFlags) -> list[str]:
        """Raw text of each sequence: the tokenizer's decode without string cleanup."""
        if not seqs:
            return []
        if self.backend is not None:
            # The Rust decode; transformers' fast decode ignores spaces_between_special_tokens.
            return self.backend.decode_batch(
                list(seqs), skip_special_tokens=flags.skip_special_tokens
            )
        return self.tokenizer.batch_decode(
            list(seqs),
            skip_special_tokens=flags.skip_special_tokens,
            spaces_between_special_tokens=flags.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def decode(self, ids: list[int], flags: DecodeFlags) -> str:
        """Final text of ``ids``, cleanup included: what ``tokenizer.decode`` returns."""
        raw = self.decode_batch([ids], flags)[0]
        return self.cleanup.apply(raw) if self.cleanup else raw

    def token_text(self, token_id: int, flags: DecodeFlags) -> str:
        """Raw text of one token decoded on its own (cached: windows start with one)."""
        cache = self._token_text.setdefault(flags, {})
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self.decode_batch([[token_id]], flags)[0]
        return text

    def bytes_of(self, ids: list[int], flags: DecodeFlags) -> bytes:
        """ByteLevel only: the bytes the decode joins before its lossy UTF-8 step."""
        table = self.token_bytes or []
        skip = self.special_ids if flags.skip_special_tokens else ()
        if len(ids) == 1:  # the common step: one token
            i = ids[0]
            return table[i] if 0 <= i < len(table) and i not in skip else b""
        return b"".join(table[i] for i in ids if 0 <= i < len(table) and i not in skip)

    def is_visible(self, token_id: int, flags: DecodeFlags) -> bool:
        """False for a special token the decode skips: it gives no context to the next one."""
        return not (flags.skip_special_tokens and token_id in self.special_ids)

    def stable_end(self, ids: list[int], start: int, flags: DecodeFlags) -> int:
        """Largest ``m`` in ``[start, len(ids)]`` before which no open byte run remains.

        A trailing run of ByteFallback pieces (skipped specials inside it do not
        end it) may still turn into different text, so it stays out of the window.
        """
        end = len(ids)
        if not self.byte_ids:
            return end
        while end > start and self._extends_run(ids[end - 1], flags):
            end -= 1
        return end

    def _extends_run(self, token_id: int, flags: DecodeFlags) -> bool:
        return token_id in self.byte_ids or not self.is_visible(token_id, flags)

    def _byte_level_table(self) -> list[bytes] | None:
        """Each token's bytes, when the whole decode is ByteLevel's bytes-then-UTF-8.

        Token text maps back to bytes through the byte-to-character table; a token
        with a character outside it (an added token such as "<｜User｜>") stands for
        its own UTF-8, as in the Rust ByteLevel decoder.
        """
        if self.backend is None or type(self.backend.decoder).__name__ != "ByteLevel":
            return None
        if self.cleanup is not None:
            return None
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        vocab: dict[str, int] = self.backend.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values(), default=-1) + 1)
        for piece, token_id in vocab.items():
            try:
                table[token_id] = bytes(byte_of[c] for c in piece)
            except KeyError:
                table[token_id] = piece.encode()
        return table

    def _stand_in_id(self) -> int | None:
        """A plain word piece (decodes alone to ASCII letters) to stand left of the output.

        Not special, added or a byte piece, so it is visible under any flags, ends no
        byte run and joins none; the first-token rules then see the output as not first.
        Decoded through the tokenizer itself: an override of ``decode_batch`` (a spy, a
        subclass) is not set up yet while ``__init__`` runs.
        """
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        excluded = self.special_ids | self.byte_ids | frozenset(added)
        candidates = [i for i in range(len(self.tokenizer)) if i not in excluded]
        for start in range(0, len(candidates), _STAND_IN_BATCH):
            batch = candidates[start : start + _STAND_IN_BATCH]
            texts = self.tokenizer.batch_decode(
                [[i] for i in batch], skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
            for token_id, text in zip(batch, texts, strict=True):
                if text.isascii() and text.isalpha():
                    return token_id
        logger.warning("no plain word piece in the vocabulary: no stand-in left context")
        return None

    def _special_ids(self) -> frozenset[int]:
        if self.backend is not None:
            added = self.backend.get_added_tokens_decoder()
            return frozenset(i for i, tok in added.items() if tok.special)
        return frozenset(self.tokenizer.all_special_ids)

    def _byte_fallback_ids(self) -> frozenset[int]:
        if self.backend is None or "ByteFallback" not in repr(self.backend.decoder):
            return frozenset()
        vocab: dict[str, int] = self.backend.get_vocab(with_added_tokens=False)
        return frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.match(piece))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, num_extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + num_extra)
            num_extra += 1
    return table
