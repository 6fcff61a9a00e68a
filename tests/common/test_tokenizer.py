"""The tokenizer loader's direct path gives AutoTokenizer's tokenizer without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.common.tokenizer import load_tokenizer

SAMPLES = ["Hello wörld 12345", "<｜User｜>hi<｜Assistant｜>", "  tabs\tand\n\nnewlines  ", "東京"]


def test_the_direct_path_equals_auto_tokenizer(default_model_dir: Path) -> None:
    direct = load_tokenizer(default_model_dir)
    auto = AutoTokenizer.from_pretrained(str(default_model_dir), local_files_only=True)
    assert type(direct) is type(auto)
    for text in SAMPLES:
        assert direct(text)["input_ids"] == auto(text)["input_ids"]
    assert direct.all_special_ids == auto.all_special_ids
    assert direct.chat_template == auto.chat_template
    ids = list(range(0, len(auto), 101))
    assert direct.decode(ids) == auto.decode(ids)


@pytest.mark.live  # a fresh interpreter: the live tier holds subprocesses
def test_the_default_model_tokenizer_loads_without_torch(default_model_dir: Path) -> None:
    probe = (
        "import sys; from services.common.tokenizer import load_tokenizer; "
        f"load_tokenizer({str(default_model_dir)!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def test_a_named_tokenizer_class_goes_through_auto_tokenizer(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint naming its own class keeps AutoTokenizer's per-model handling."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((default_model_dir / name).read_bytes())
    (tmp_path / "config.json").write_bytes((default_model_dir / "config.json").read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    assert type(load_tokenizer(tmp_path)).__name__ == "Qwen2Tokenizer"
