"""The registry: which native module serves an architecture, and the one-line refusal of
a checkpoint no native path runs, given before the scheduler builds kernels or loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.scheduler.model_executor.models.gemma3 import Gemma3ForCausalLM
from services.scheduler.model_executor.models.registry import (
    UnsupportedModelError,
    check_native_support,
    native_model_class,
)
from tests.scheduler.model_executor.models.test_config import raw_config


def write_config(model_dir: Path, **overrides: Any) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(raw_config(**overrides)))
    return model_dir


def test_native_model_class_by_architecture() -> None:
    assert native_model_class("Gemma3ForCausalLM") is Gemma3ForCausalLM
    assert native_model_class("GPT2LMHeadModel") is None


@pytest.mark.parametrize(
    ("overrides", "missing"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "no native path for architecture GPT2LMHeadModel"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"attn_logit_softcapping": 50.0}, "soft-capping"),
        ({"hidden_act": "relu2"}, "unsupported activation 'relu2'"),
    ],
)
def test_unservable_checkpoint_is_refused_in_one_line(
    tmp_path: Path, overrides: dict[str, Any], missing: str
) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        check_native_support(write_config(tmp_path / "ckpt", **overrides))
    message = str(info.value)
    assert "\n" not in message and missing in message and "--model-impl transformers" in message


@pytest.mark.live
def test_scheduler_refuses_before_building_kernels(tmp_path: Path) -> None:
    """The scheduler process exits at once with the line; no kernels/ was started."""
    model_dir = write_config(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    done = subprocess.run(
        [sys.executable, "-m", "services.scheduler", "--model", str(model_dir), "--build-kernels"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenline-scheduler: unsupported architectures ['GPT2LMHeadModel']")
    assert not (model_dir / "kernels").exists()
