"""Loading the model directory's tokenizer, the same way in every service."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class TailDecoder(Protocol):
    """What a Hugging Face tokenizer's ``decode`` offers (a list of ids in, text out)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    path = Path(model_dir)
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer in {path}; build the default model with `make model`")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
