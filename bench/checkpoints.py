"""Random checkpoints at the shapes of models people serve, for the benchmarks (offline).

``python -m bench.checkpoints --shape qwen3-0.6b`` (``make model-qwen3``) and ``--shape
qwen3-moe`` (``make model-moe``) build, with transformers' own config and model classes,
a seeded random Qwen3 at Qwen3-0.6B's dimensions and a small Qwen3-MoE, saved in bf16 with
the default model's tokenizer (its 129,280-entry vocabulary instead of Qwen's 151,936, so
every service and every peer reads the same tokens). Nothing is downloaded. The weights are
random: the text is nonsense, and what the serving benchmarks measure (``ignore_eos``,
fixed output lengths) does not depend on it. A finished build leaves a stamp naming its
shape and seed, so a second call with the same arguments returns at once.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from services.common.default_model import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ensure_default_model

STAMP = "bench_checkpoint.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DEFAULT_TOKENIZER_DIR = Path("models/tokenline-tiny")


@dataclass(frozen=True, slots=True)
class BenchShape:
    """A config class and the fields that make it one model's shape."""

    config_class: str
    model_class: str
    fields: dict[str, Any]


_QWEN3_ATTENTION = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40_960,
    "tie_word_embeddings": True,
}
SHAPES = {
    # Qwen3-0.6B: 28 layers, MLP 3,072 (596 M parameters with this vocabulary).
    "qwen3-0.6b": BenchShape(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {**_QWEN3_ATTENTION, "num_hidden_layers": 28, "intermediate_size": 3072},
    ),
    # Qwen3-30B-A3B's layout scaled down: 16 layers of 32 experts of 512, top 4 with
    # normalised router weights (~0.96 B parameters, ~0.36 B active per token).
    "qwen3-moe": BenchShape(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_QWEN3_ATTENTION,
            "num_hidden_layers": 16,
            "intermediate_size": 2048,
            "moe_intermediate_size": 512,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
        },
    ),
}


def _stamp(shape: str, seed: int) -> dict[str, Any]:
    return {"shape": shape, "seed": seed, "fields": asdict(SHAPES[shape])}


def build(shape: str, out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """``out_dir`` holding the ``shape`` checkpoint; rebuilt only when its stamp differs."""
    stamp_path = out_dir / STAMP
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) == _stamp(shape, seed):
        return out_dir
    tokenizer_dir = tokenizer_dir or ensure_default_model(DEFAULT_TOKENIZER_DIR)
    spec = SHAPES[shape]
    config = getattr(transformers, spec.config_class)(
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **spec.fields,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = getattr(transformers, spec.model_class)(config).to(torch.bfloat16).eval()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed, so an interrupted build never looks finished.
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
        staging = Path(tmp) / "checkpoint"
        model.save_pretrained(staging)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, staging / name)
        (staging / STAMP).write_text(json.dumps(_stamp(shape, seed), indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"{args.shape}: {build(args.shape, args.out, seed=args.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
