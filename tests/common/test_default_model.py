"""The default model builder: deterministic, offline, loadable by HF, our chat template;
and its small shape (`make model-small`), checked on a scaled-down instance."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from services.common import default_model
from services.common.default_model import build_default_model, ensure_default_model

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_dir)


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def test_build_is_byte_identical(tmp_path: Path) -> None:
    first = build_default_model(tmp_path / "a")
    second = build_default_model(tmp_path / "b")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert "model.safetensors" in names
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_config_matches_the_tokenizer(
    default_model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == 129280
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [19923, 2058]


def test_chat_template_two_turns(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [_text("Hel"), _text("lo!")]},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"{BOS}Be brief.\n\n<｜User｜>Hi<｜Assistant｜>Hello!{EOS}<｜User｜>Bye<｜Assistant｜>"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[0] == 0 and ids.count(1) == 1  # BOS once, EOS after the assistant turn


def test_chat_template_tools_and_tool_calls(tokenizer: PreTrainedTokenizerBase) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": "1+?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "2"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[tool, tool], tokenize=False)
    tool_json = json.dumps(tool)
    assert text == (
        f"{BOS}You can call these tools:\n{tool_json}\n{tool_json}\n\n"
        "<｜User｜>1+?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>"
        f'{{"a": 1}}<｜tool▁call▁end｜><｜tool▁calls▁end｜>{EOS}'
        "<｜tool▁output▁begin｜>2<｜tool▁output▁end｜>"
    )


def test_ensure_skips_current_and_refuses_foreign(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with pytest.raises(FileExistsError):
        ensure_default_model(foreign)
    assert default_model.main(["--out", str(foreign)]) == 1


def test_ensure_reuses_a_current_build(default_model_dir: Path) -> None:
    before = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(default_model_dir) == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_small_shape_is_qwen2_5_0_5b_sized_and_transformers_counts_the_same() -> None:
    """`make model-small`'s dimensions; the parameter count is checked against a Llama
    that transformers builds from the config on the meta device (no memory, no weights)."""
    config = default_model._config(default_model.SMALL)
    assert (config["hidden_size"], config["num_hidden_layers"]) == (896, 24)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (14, 2)
    assert (config["intermediate_size"], config["vocab_size"]) == (4864, 129280)
    assert config["tie_word_embeddings"] is True
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    assert sum(p.numel() for p in model.parameters()) == default_model.SMALL.num_params
    assert round(default_model.SMALL.num_params / 1e6) == 474


def test_a_scaled_down_small_build_has_its_shape_and_names_it(tmp_path: Path) -> None:
    """The small builder's path at a fraction of the size: config, tensor shapes against
    transformers' own Llama, and a build info that tells it from the tiny default."""
    shape = dataclasses.replace(default_model.SMALL, name="small-test", hidden=56,
                                head_dim=4, intermediate=304, num_layers=2)  # fmt: skip
    out = build_default_model(tmp_path / "small", shape=shape)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["head_dim"], config["num_hidden_layers"]) == (56, 4, 2)
    with torch.device("meta"):
        expected = LlamaForCausalLM(LlamaConfig(**config)).state_dict()
    tensors = load_file(out / "model.safetensors")
    expected.pop("lm_head.weight")  # tied to the embedding: not stored
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        k: tuple(v.shape) for k, v in expected.items()
    }
    assert default_model.is_current_build(out, shape=shape)
    assert not default_model.is_current_build(out)  # not the tiny default
    assert default_model.create_parser().parse_args(["--shape", "small"]).shape == "small"
