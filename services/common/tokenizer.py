"""Loading the model directory's tokenizer, the same way in every service.

A checkpoint whose ``tokenizer_config.json`` names the generic fast tokenizer is loaded
by that class directly. ``AutoTokenizer`` would first load the model's config class,
which imports torch (about 3 s of CPU), and the frontend and detokenizer have no other
use for torch. Any other tokenizer class goes through ``AutoTokenizer`` as before, with
its per-model fixes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from transformers import PreTrainedTokenizerBase

# The class names transformers resolves to its plain `tokenizers`-backed class.
GENERIC_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


class TailDecoder(Protocol):
    """What a Hugging Face tokenizer's ``decode`` offers (a list of ids in, text out)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    path = Path(model_dir)
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer in {path}; build the default model with `make model`")
    if _names_generic_fast_class(path):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _names_generic_fast_class(path: Path) -> bool:
    """True when the directory's own files pick the generic class and need no remote code."""
    config_file = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").exists() or not config_file.exists():
        return False
    config = json.loads(config_file.read_text(encoding="utf-8"))
    return config.get("tokenizer_class") in GENERIC_FAST_CLASSES and "auto_map" not in config
