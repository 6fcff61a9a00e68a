"""ModelConfig: every HF config layout we accept, and clear refusals for what we cannot run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.scheduler.model_executor.models.config import ModelConfig


def raw_config(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "max_position_embeddings": 2048,
    }
    return base | overrides


def test_default_model_dir(default_model_dir: Path) -> None:
    config = ModelConfig.from_dir(default_model_dir)
    assert (config.num_layers, config.hidden_size, config.num_heads) == (4, 256, 4)
    assert (config.num_kv_heads, config.head_dim, config.intermediate_size) == (2, 64, 768)
    assert config.vocab_size == 129280 and config.tie_word_embeddings
    assert config.eos_token_ids == (1,) and config.dtype == torch.bfloat16
    assert config.max_context_len == 4096 and config.rope_scaling.rope_type == "default"


def test_defaults_when_fields_are_absent() -> None:
    config = ModelConfig.from_dict(raw_config())
    assert config.num_kv_heads == 4 and config.head_dim == 64
    assert config.rope_theta == 10000.0 and config.dtype == torch.float32
    assert not config.attention_bias and config.eos_token_ids == ()


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
            "rope_theta": 500000.0,
        },
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    ],
)
@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_rope_frequencies_match_hf(rope: dict[str, Any], layout: str) -> None:
    if layout == "rope_parameters":  # transformers 5 layout
        raw = raw_config(rope_parameters=rope)
    else:  # legacy layout: theta beside the scaling dict, "type" instead of "rope_type"
        scaling = {("type" if k == "rope_type" else k): v for k, v in rope.items()}
        raw = raw_config(rope_theta=scaling.pop("rope_theta"), rope_scaling=scaling)
    ours = ModelConfig.from_dict(raw)
    hf_config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config)
    torch.testing.assert_close(ours.inv_freq(), expected, rtol=1e-6, atol=0.0)


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_dict(raw_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_qwen2_biases_and_ignored_window() -> None:
    raw = raw_config(
        architectures=["Qwen2ForCausalLM"],
        sliding_window=1024,
        use_sliding_window=False,
        tie_word_embeddings=True,
    )
    config = ModelConfig.from_dict(raw)
    assert config.attention_bias and not config.o_proj_bias
    assert config.sliding_window is None and config.max_context_len == 2048


def test_llama_attention_bias_covers_o_proj() -> None:
    config = ModelConfig.from_dict(raw_config(attention_bias=True))
    assert config.attention_bias and config.o_proj_bias


def test_mistral_window_is_on_every_layer_and_leaves_the_context() -> None:
    raw = raw_config(architectures=["MistralForCausalLM"], sliding_window=1024)
    config = ModelConfig.from_dict(raw)
    assert config.layer_windows == (1024, 1024) and config.max_context_len == 2048


def test_gemma3_legacy_layout_interleaves_windows_and_rope_bases() -> None:
    raw = raw_config(
        architectures=["Gemma3ForCausalLM"],
        num_hidden_layers=6,
        sliding_window=512,
        sliding_window_pattern=3,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=256,
    )
    config = ModelConfig.from_dict(raw)
    assert config.layer_windows == (512, 512, None, 512, 512, None)
    assert config.rope_theta == 1e6 and config.local_rope_theta == 1e4
    assert config.rope_scaling.rope_type == "linear" and config.attn_scale == 256**-0.5


def test_moe_layers_and_router_normalisation() -> None:
    qwen = raw_config(
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    moe = ModelConfig.from_dict(qwen).moe
    assert moe is not None and moe.sparse_layers == {1} and not moe.norm_topk_prob
    mixtral = raw_config(
        architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2
    )
    moe = ModelConfig.from_dict(mixtral).moe
    assert moe is not None and moe.norm_topk_prob and moe.sparse_layers == {0, 1}
    assert moe.intermediate_size == 512


def test_eos_ids_merge_config_and_generation_config() -> None:
    config = ModelConfig.from_dict(raw_config(eos_token_id=[5, 7]), {"eos_token_id": [7, 9]})
    assert config.eos_token_ids == (5, 7, 9)


@pytest.mark.parametrize(
    ("key", "name", "dtype"),
    [("dtype", "float16", torch.float16), ("torch_dtype", "bfloat16", torch.bfloat16)],
)
def test_checkpoint_dtype(key: str, name: str, dtype: torch.dtype) -> None:
    assert ModelConfig.from_dict(raw_config(**{key: name})).dtype == dtype
