"""bench.checkpoints: the builder's shapes load on the native path, and a finished build is
reused, not redone (shrunk shapes: the real ones take a minute and a gigabyte each)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench import checkpoints
from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.model_executor.models.model_impl import resolve_model_impl

SHRUNK = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.fixture
def tiny_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = {
        name: replace(
            shape,
            fields={**shape.fields, **SHRUNK, "num_hidden_layers": 2, "intermediate_size": 96}
            | ({"moe_intermediate_size": 32, "num_experts": 4} if "moe" in name else {}),
        )
        for name, shape in checkpoints.SHAPES.items()
    }
    monkeypatch.setattr(checkpoints, "SHAPES", shapes)


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-moe"])
def test_each_shape_loads_natively_with_the_default_tokenizer(
    shape: str, tiny_shapes: None, tmp_path: Path, default_model_dir: Path
) -> None:
    out = checkpoints.build(shape, tmp_path / shape, tokenizer_dir=default_model_dir)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [checkpoints.SHAPES[shape].model_class]
    assert (
        config["vocab_size"]
        == json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    )
    assert (out / "tokenizer.json").read_bytes() == (
        default_model_dir / "tokenizer.json"
    ).read_bytes()
    with safe_open(out / "model.safetensors", "pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        assert {f.get_slice(k).get_dtype() for k in names} == {"BF16"}
    impl = resolve_model_impl(out)
    assert (impl.path, impl.dtype) == ("native", torch.bfloat16)
    _, loaded = load_model(out, "float32", "cpu")
    assert loaded.num_layers == 2


def test_a_finished_build_is_reused_and_another_seed_rebuilds(
    tiny_shapes: None, tmp_path: Path, default_model_dir: Path
) -> None:
    out = checkpoints.build("qwen3-0.6b", tmp_path / "m", tokenizer_dir=default_model_dir)
    weights = out / "model.safetensors"
    first = weights.stat().st_mtime_ns
    checkpoints.build("qwen3-0.6b", out, tokenizer_dir=default_model_dir)
    assert weights.stat().st_mtime_ns == first
    before = weights.read_bytes()
    checkpoints.build("qwen3-0.6b", out, seed=1, tokenizer_dir=default_model_dir)
    assert weights.read_bytes() != before
    assert json.loads((out / checkpoints.STAMP).read_text())["seed"] == 1
