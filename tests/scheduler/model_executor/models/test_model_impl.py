"""``--model-impl``: which path serves a checkpoint, and the one-line refusal of what no
path can run, decided from config.json alone (these directories hold no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.model_executor.models.model_impl import (
    UnsupportedModelError,
    resolve_model_impl,
)
from services.scheduler.model_executor.models.transformers_model import load_transformers_model


def config_only(tmp_path: Path, model_type: str, architecture: str, **fields: object) -> Path:
    """A checkpoint directory with just a config.json, as transformers writes it."""
    config = AutoConfig.for_model(model_type, architectures=[architecture], **fields)
    config.save_pretrained(tmp_path)
    return tmp_path


def refusal(model_dir: Path, requested: str = "auto") -> str:
    with pytest.raises(UnsupportedModelError) as info:
        resolve_model_impl(model_dir, requested)
    message = str(info.value)
    assert "\n" not in message  # one line for the operator
    return message


def test_auto_prefers_native_and_transformers_can_be_forced(default_model_dir: Path) -> None:
    assert resolve_model_impl(default_model_dir, "auto").path == "native"
    assert resolve_model_impl(default_model_dir, "native").path == "native"
    forced = resolve_model_impl(default_model_dir, "transformers")
    assert (forced.path, forced.architecture) == ("transformers", "LlamaForCausalLM")


def test_architecture_without_native_code_goes_to_transformers(tmp_path: Path) -> None:
    model_dir = config_only(tmp_path, "olmo2", "Olmo2ForCausalLM")
    impl = resolve_model_impl(model_dir, "auto")
    assert (impl.path, impl.architecture) == ("transformers", "Olmo2ForCausalLM")
    message = refusal(model_dir, "native")
    assert "Olmo2ForCausalLM" in message and "--model-impl native" in message
    assert "use --model-impl transformers" in message


@pytest.mark.parametrize(
    ("model_type", "architecture", "missing"),
    [
        ("t5", "T5ForConditionalGeneration", "encoder-decoder"),
        ("bert", "BertForMaskedLM", "not a causal LM"),
        ("gemma2", "Gemma2ForCausalLM", "soft-capping"),
    ],
)
def test_what_neither_path_runs_is_refused_in_one_line(
    tmp_path: Path, model_type: str, architecture: str, missing: str
) -> None:
    model_dir = config_only(tmp_path, model_type, architecture)
    message = refusal(model_dir)
    assert message.startswith(f"unsupported architectures ['{architecture}']")
    assert missing in message
    with pytest.raises(UnsupportedModelError):  # the loader refuses before reading weights
        load_model(model_dir, "float32", "cpu", model_impl="transformers")


def test_model_type_unknown_to_transformers_is_refused(tmp_path: Path) -> None:
    config = {"architectures": ["MadeUpForCausalLM"], "model_type": "made_up_lm"}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert "cannot read its config" in refusal(tmp_path)
    assert "unknown --model-impl" in refusal(tmp_path, "fast")


def test_attention_sinks_are_refused_before_weights_are_read(tmp_path: Path) -> None:
    """gpt-oss's sinks are a parameter, not a config field: the built (meta) model shows
    them, and the loader refuses before it opens a weight file."""
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    shape |= {"num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64}
    model_dir = config_only(
        tmp_path, "gpt_oss", "GptOssForCausalLM", vocab_size=1000, num_local_experts=4, **shape
    )
    assert resolve_model_impl(model_dir).path == "transformers"  # config.json passes
    with pytest.raises(UnsupportedModelError, match="attention sinks") as info:
        load_transformers_model(model_dir, torch.float32, torch.device("cpu"))
    assert "\n" not in str(info.value)
