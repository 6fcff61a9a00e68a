"""Tiny random checkpoints of architectures tokenline has no native code for, built with
transformers' own config and model classes and saved beside the default model's tokenizer.

Seeded and small (hidden 64, 2 layers). Weights are redrawn at scales that make greedy
decoding decisive (logit gaps well above float32 noise), so a wrong attention or head
shows as a different token rather than hiding in a near-tie. Each config sets the
architecture's own quirks away from their defaults (Granite's multipliers and
``logits_scaling``, Cohere's ``logit_scale``), so parity covers them.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB_SIZE = 129280  # the bundled DeepSeek tokenizer
_SHAPE = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}
# model_type -> its quirks, set away from the defaults
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "olmo2": {"tie_word_embeddings": False},
    "granite": {
        "tie_word_embeddings": False,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 2.0,
    },
    "cohere": {"tie_word_embeddings": True, "logit_scale": 0.5},
}
# MoE architectures without native code, proven in process only (no live stack of their own:
# the suite's time); transformers stores their experts as [num_experts, out, in] stacks.
MOE_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "olmoe": {"tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2},
}
_GAINS = {"q_proj": 3.0, "k_proj": 3.0, "o_proj": 2.0, "down_proj": 2.0, "lm_head": 6.0}


def build_checkpoint(
    model_type: str,
    out_dir: Path,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    chat_template: bool = True,
) -> Path:
    """Write a float32 ``model_type`` checkpoint and the tokenizer of ``tokenizer_dir``
    (without its chat template unless ``chat_template``) into ``out_dir``."""
    quirks = ARCHITECTURES.get(model_type) or MOE_ARCHITECTURES[model_type]
    config = AutoConfig.for_model(model_type, **_SHAPE, **quirks)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    model.save_pretrained(out_dir)
    _copy_tokenizer(tokenizer_dir, out_dir, chat_template)
    return out_dir


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "embed_tokens" in name:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        elif param.dim() in (2, 3):  # a matrix, or a stack of experts' matrices
            gain = next((g for key, g in _GAINS.items() if key in name), 1.0)
            std = gain / math.sqrt(param.shape[-1])
            param.copy_(torch.randn(param.shape, generator=gen) * std)
        elif name.endswith("weight"):  # norms: near one, not exactly, so misloading shows
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        else:
            param.copy_(0.02 * torch.randn(param.shape, generator=gen))


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path, chat_template: bool) -> None:
    shutil.copyfile(tokenizer_dir / "tokenizer.json", out_dir / "tokenizer.json")
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if chat_template:
        shutil.copyfile(tokenizer_dir / "chat_template.jinja", out_dir / "chat_template.jinja")
    else:
        tok_config.pop("chat_template", None)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config), encoding="utf-8")
