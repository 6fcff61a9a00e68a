"""Tiny random checkpoints of every natively served architecture, for parity tests.

Each is built with transformers' own config and model classes (seeded), saved with
``save_pretrained`` and given the default model's tokenizer files, at shapes that keep the
architecture's features: experts and top-k, sliding-window layers shorter than the test
prompts, per-layer-type RoPE, partial rotary, LongRoPE with a short original context.
Weights are rescaled after HF's init the way the default model's are (peaked logits, sharp
attention), so greedy decoding rarely meets near-ties and does not just repeat a token.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from services.common.default_model import EOS_ID, VOCAB_SIZE

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
SLIDING_WINDOW = 8  # shorter than every test prompt but the shortest
LONGROPE_ORIGINAL = 32  # Phi-3's original context: long prompts pass it
NUM_EXPERTS, TOP_K = 4, 2
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": VOCAB_SIZE,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "bos_token_id": 0,
    "eos_token_id": EOS_ID,
    "pad_token_id": 2,
    "tie_word_embeddings": True,
    "initializer_range": HIDDEN**-0.5,
    "max_position_embeddings": 256,
}


def _qwen3() -> dict[str, Any]:
    return {"head_dim": HEAD_DIM}


def _qwen3_moe() -> dict[str, Any]:
    # Three layers with decoder_sparse_step 1 and layer 1 dense: both MLP kinds run.
    return {
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 3,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    }


def _mixtral() -> dict[str, Any]:
    return {"num_local_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K}


def _mistral() -> dict[str, Any]:
    return {"sliding_window": SLIDING_WINDOW}


def _gemma3() -> dict[str, Any]:
    return {
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 3,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 30.0,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }


def _phi3() -> dict[str, Any]:
    half = HEAD_DIM // 4  # rotary dims / 2 with partial_rotary_factor 0.5
    return {
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": LONGROPE_ORIGINAL,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + i for i in range(half)],
        },
    }


# name -> (config class, model class, config overrides)
ARCHITECTURES: dict[str, tuple[str, str, Callable[[], dict[str, Any]]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _qwen3),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _qwen3_moe),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", _mixtral),
    "mistral": ("MistralConfig", "MistralForCausalLM", _mistral),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _phi3),
}
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")


def build_hf_model(name: str, *, seed: int = 0, force_routing: bool = False) -> PreTrainedModel:
    """The seeded random HF model of ``name`` (a key of ARCHITECTURES), float32.

    ``force_routing`` (MoE only): every token of every layer routes to experts 0 and 1,
    by construction (see ``_force_routing``), whatever its content."""
    config_cls, model_cls, overrides = ARCHITECTURES[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **overrides()})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _sharpen(model)
    if force_routing:
        _force_routing(model)
    return model


def save_checkpoint(model: PreTrainedModel, out_dir: Path, tokenizer_dir: Path) -> Path:
    """``save_pretrained`` into ``out_dir`` with the tokenizer files of ``tokenizer_dir``."""
    model.save_pretrained(out_dir)
    for file_name in _TOKENIZER_FILES:
        if (tokenizer_dir / file_name).is_file():
            shutil.copyfile(tokenizer_dir / file_name, out_dir / file_name)
    return out_dir


@torch.no_grad()
def _sharpen(model: PreTrainedModel) -> None:
    """Larger embeddings (peaked logits) and q/k (position-dependent attention)."""
    for name, param in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            param.mul_(8.0)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            param.mul_(3.0)
        elif name.endswith("qkv_proj.weight"):
            rows = HEADS * HEAD_DIM + KV_HEADS * HEAD_DIM
            param[:rows].mul_(3.0)


@torch.no_grad()
def _force_routing(model: PreTrainedModel) -> None:
    """Hidden channel 0 holds one positive constant through the whole residual stream (the
    embedding sets it; no attention or expert output writes it), and each router reads only
    that channel with weights falling by expert index: expert 0 then 1 win for every token,
    by margins no rounding can flip."""
    model.get_input_embeddings().weight[:, 0] = 20.0
    for name, param in model.named_parameters():
        if name.endswith("o_proj.weight"):
            param[0] = 0.0
        elif name.endswith("experts.down_proj"):  # [E, hidden, I]
            param[:, 0] = 0.0
        elif name.endswith("down_proj.weight"):  # a dense layer's MLP
            param[0] = 0.0
        elif name.endswith("gate.weight") and param.shape[0] == NUM_EXPERTS:
            param.zero_()
            param[:, 0] = torch.arange(NUM_EXPERTS, 0, -1, dtype=param.dtype)
