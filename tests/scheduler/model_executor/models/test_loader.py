"""The loader on small HF checkpoints of each supported architecture, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.loader import load_model

SHAPE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}
ARCHITECTURES = {
    # untied head, bias everywhere in attention, Llama 3.1 rope scaling, sharded files
    "llama": lambda: LlamaForCausalLM(
        LlamaConfig(**SHAPE, attention_bias=True, rope_parameters=LLAMA3_ROPE)
    ),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=128)),
}


def save_hf_model(name: str, path: Path) -> PreTrainedModel:
    torch.manual_seed(0)
    model = ARCHITECTURES[name]().eval()
    with torch.no_grad():  # HF's init leaves biases at zero; make them matter
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, max_shard_size="100KB" if name == "llama" else "50GB")
    return model


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_logits_match_hf(name: str, tmp_path: Path) -> None:
    hf_model = save_hf_model(name, tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists() == (name == "llama")
    model, config = load_model(tmp_path, torch.float32, "cpu")
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    pool = KVPool(64, config.num_layers, config.num_kv_heads, config.head_dim, torch.float32)
    slots = pool.allocate(40)
    # prefill 30 tokens, then a 9-token chunk, then one decode token
    got = [
        model(ForwardBatch.build([prompt[a:b]], [a], [slots[:b]]), pool, all_logits=True)
        for a, b in ((0, 30), (30, 39), (39, 40))
    ]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    save_hf_model("qwen2", tmp_path)
    return tmp_path


def rewrite_weights(model_dir: Path, edit: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    for name, tensor in edit.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def test_missing_weight_is_an_error(hf_dir: Path) -> None:
    rewrite_weights(hf_dir, {"model.layers.1.self_attn.k_proj.weight": None})
    with pytest.raises(ValueError, match=r"lacks weights.*layers\.1\.self_attn\.qkv_proj"):
        load_model(hf_dir, torch.float32)


def test_unexpected_weight_is_an_error(hf_dir: Path) -> None:
    rewrite_weights(hf_dir, {"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="does not.*mlp.extra"):
        load_model(hf_dir, torch.float32)


def test_shape_mismatch_is_an_error(hf_dir: Path) -> None:
    rewrite_weights(hf_dir, {"model.layers.0.mlp.up_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError, match=r"up_proj.weight has shape \(64, 64\)"):
        load_model(hf_dir, torch.float32)


def test_dtype_names_and_tied_head(default_model_dir: Path) -> None:
    model, _ = load_model(default_model_dir, "float32")
    assert model.lm_head.weight.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(default_model_dir, "fp8")
