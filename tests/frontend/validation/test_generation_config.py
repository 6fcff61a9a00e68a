"""generation_config.json sampling defaults (services/frontend/validation/generation_config.py); the
live check that they reach requests is tests/integration/test_vllm_semantics.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from services.common.sampling_params import SamplingDefaults
from services.frontend.__main__ import parse_args
from services.frontend.validation.generation_config import (
    GenerationDefaults,
    load_generation_defaults,
    log_generation_defaults,
)

VOCAB = 1000
QWEN_LIKE = {
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 512,
}


def model_dir(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_auto_reads_the_sampling_fields_and_max_new_tokens(tmp_path: Path) -> None:
    defaults = load_generation_defaults(model_dir(tmp_path, QWEN_LIKE), "auto", VOCAB)
    assert defaults.sampling == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05
    )
    assert defaults.max_new_tokens == 512
    assert defaults.sampling.to_pb().top_k == 20
    assert not defaults.sampling.to_pb().HasField("min_p")  # only what the file sets


def test_vllm_turns_it_off_and_a_folder_path_reads_that_folder(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "model", {"temperature": 0.3})
    other = model_dir(tmp_path / "other", {"top_k": 5})
    assert load_generation_defaults(model, "vllm", VOCAB) == GenerationDefaults()
    assert load_generation_defaults(model, str(other), VOCAB).sampling == SamplingDefaults(top_k=5)
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_generation_defaults(model, str(tmp_path), VOCAB)


def test_a_model_without_the_file_or_without_sampling_keys_keeps_the_built_ins(
    tmp_path: Path,
) -> None:
    assert load_generation_defaults(tmp_path, "auto", VOCAB).is_empty
    eos_only = model_dir(tmp_path, {"bos_token_id": 0, "eos_token_id": 1})
    assert load_generation_defaults(eos_only, "auto", VOCAB).is_empty


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"repetition_penalty": "high"}, "repetition_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_a_bad_value_stops_the_start_naming_file_and_field(
    tmp_path: Path, config: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=f"generation_config.json: {named}"):
        load_generation_defaults(model_dir(tmp_path, config), "auto", VOCAB)


def test_the_applied_defaults_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    defaults = GenerationDefaults(SamplingDefaults(top_k=20), max_new_tokens=64)
    with caplog.at_level(logging.INFO, logger="services.frontend.validation.generation_config"):
        log_generation_defaults(defaults, "auto")
    assert "'top_k': 20" in caplog.text and "'max_tokens': 64" in caplog.text


def test_the_flag_defaults_to_auto() -> None:
    assert parse_args(["--model", "m"]).generation_config == "auto"
    assert parse_args(["--model", "m", "--generation-config", "vllm"]).generation_config == "vllm"
