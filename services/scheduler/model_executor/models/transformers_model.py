"""Any decoder-only causal LM transformers knows, run inside tokenline's engine.

transformers' modeling code computes everything but attention: embeddings, norms,
rotary (from the step's ``position_ids``), MLPs and the LM head, so each
architecture's quirks stay its own. Attention is tokenline's: the model is built with
``attn_implementation="tokenline"``, a function registered through transformers'
``AttentionInterface``, which hands each layer's q/k/v to the engine's
``AttentionBackend`` with the step's plan, so K/V live in the scheduler's KV pool and
continuous batching, the radix cache and chunked prefill work as on the native path.
transformers skips building a mask for an implementation it has no mask function for,
so the flat step ([1, T] tokens of many requests) reaches attention as it is. vLLM's
Transformers backend works the same way.

The LM head runs through the model's own ``forward`` with the backbone swapped for a
pass-through, so head-side scaling (Granite's ``logits_scaling``, Cohere's
``logit_scale``, final soft-capping) is the architecture's own code, not ours.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.utils import logging as hf_logging

from services.common.eos import eos_id_union
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention import create_attention_backend
from services.scheduler.model_executor.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.config import ModelConfig, RopeScaling
from services.scheduler.model_executor.models.model_impl import UnsupportedModelError
from services.scheduler.model_executor.standalone_step import StandaloneStep

logger = logging.getLogger(__name__)

ATTENTION_NAME = "tokenline"
_UNHONOURED_PARAMETERS = {"sinks": "attention sinks"}
_STEP_KWARG = "tokenline_step"


@dataclass(slots=True)
class _Step:
    """What the attention function needs of one forward step, passed down as a kwarg."""

    backend: AttentionBackend
    meta: AttentionMetadata
    kv_pool: KVPool


def tokenline_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract over tokenline's backend.

    ``query`` [1, heads, T, D] and ``key``/``value`` [1, kv_heads, T, D], rotary applied;
    returns [1, T, heads, D]. The causal structure comes from the step's plan, not
    ``attention_mask`` (transformers builds none for this implementation).
    """
    step = kwargs.get(_STEP_KWARG)
    if not isinstance(step, _Step):
        raise RuntimeError("tokenline attention runs only inside TransformersCausalLM")
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"tokenline attention does not compute {unsupported}")
    out = step.backend.forward(
        query[0].transpose(0, 1).contiguous(),
        key[0].transpose(0, 1).contiguous(),
        value[0].transpose(0, 1).contiguous(),
        layer=int(module.layer_idx),  # type: ignore[arg-type]
        meta=step.meta,
        kv_pool=step.kv_pool,
        scale=float(scaling if scaling is not None else module.scaling),  # type: ignore[arg-type]
    )
    return out.unsqueeze(0), None


class _HiddenPassThrough(nn.Module):
    """Stands in for the backbone inside the CausalLM, so its ``forward`` is just the head.
    The MoE output type: an MoE head reads ``router_logits`` (None: no auxiliary loss)."""

    def forward(self, inputs_embeds: torch.Tensor, **_: Any) -> MoeModelOutputWithPast:
        return MoeModelOutputWithPast(last_hidden_state=inputs_embeds)


class TransformersCausalLM(StandaloneStep):
    """A transformers CausalLM behind the interface ``ModelRunner`` calls."""

    def __init__(
        self, causal_lm: PreTrainedModel, config: ModelConfig, attn_backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        prefix = causal_lm.base_model_prefix
        self.backbone = getattr(causal_lm, prefix)
        setattr(causal_lm, prefix, _HiddenPassThrough())
        self.head = causal_lm

    def hidden_states(
        self, batch: ForwardBatch, meta: AttentionMetadata, kv_pool: KVPool
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] of every new token of ``batch``;
        writes each layer's new K/V to ``kv_pool`` at ``batch.out_cache_loc`` only."""
        out = self.backbone(
            input_ids=batch.input_ids[None],
            position_ids=batch.positions[None],
            use_cache=False,
            **{_STEP_KWARG: _Step(self.attn_backend, meta, kv_pool)},
        )
        hidden: torch.Tensor = out.last_hidden_state[0]
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] through the architecture's own head (and its scaling)."""
        logits: torch.Tensor = self.head(inputs_embeds=hidden[None], use_cache=False).logits[0]
        return logits


def load_transformers_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str = "torch",
    decode_kernel: bool = False,
) -> tuple[TransformersCausalLM, ModelConfig]:
    """Build the checkpoint's transformers CausalLM on the meta device to refuse what
    tokenline's attention cannot honour, then load it with ``from_pretrained`` in ``dtype``
    on ``device``, and wrap it."""
    AttentionInterface.register(ATTENTION_NAME, tokenline_attention)
    hf_config = AutoConfig.from_pretrained(model_dir)
    with _parameters_on_meta():
        skeleton = AutoModelForCausalLM.from_config(
            hf_config, dtype=dtype, attn_implementation=ATTENTION_NAME
        )
    refuse_unhonoured_parameters(skeleton)
    del skeleton
    causal_lm = _load_pretrained(model_dir, hf_config, dtype)
    nn.Module.to(causal_lm, device).eval()  # transformers' own ``to`` wrapper is mistyped
    config = _model_config(hf_config, model_dir, dtype)
    backend = create_attention_backend(attention_backend, device, decode_kernel=decode_kernel)
    logger.info(
        "model %s: %s through transformers, %s on %s",
        model_dir.name,
        config.architecture,
        dtype,
        device,
    )
    return TransformersCausalLM(causal_lm, config, backend).eval(), config


def refuse_unhonoured_parameters(causal_lm: PreTrainedModel) -> None:
    """Attention weights the backends have no input for (gpt-oss's per-head sinks) show only
    in the built modules, not the config: refused here, before any weight is read."""
    for name, _ in causal_lm.named_parameters():
        feature = _UNHONOURED_PARAMETERS.get(name.rsplit(".", 1)[-1])
        if feature is not None:
            raise UnsupportedModelError(
                f"unsupported architectures {causal_lm.config.architectures}: it needs "
                f"{feature} ({name}), which tokenline's attention does not compute"
            )


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (no random init is
    spent on weights the checkpoint overwrites); buffers such as rotary tables are
    computed for real, as the module's own ``__init__`` computes them."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _load_pretrained(
    model_dir: Path, hf_config: PretrainedConfig, dtype: torch.dtype
) -> PreTrainedModel:
    """The CausalLM with every checkpoint tensor in its parameter, or an error naming the
    first few that are not: a half-loaded model would serve plausible garbage.

    ``from_pretrained`` and not a plain ``load_state_dict``: transformers renames and fuses
    tensors on load where its modules store them otherwise than checkpoints do (the
    per-expert ``experts.N.gate_proj`` / ``up_proj`` of MoE checkpoints become one
    ``experts.gate_up_proj`` stack in transformers 5), and keeps that mapping per
    architecture. The folder is local, so nothing is fetched."""
    hf_logging.disable_progress_bar()  # a bar per load in the scheduler's log otherwise
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        model_dir,
        config=hf_config,
        dtype=dtype,
        attn_implementation=ATTENTION_NAME,
        output_loading_info=True,
    )
    causal_lm: PreTrainedModel = loaded[0]
    info: dict[str, Any] = loaded[1]
    if info["unexpected_keys"]:
        raise ValueError(
            f"checkpoint has weights the model does not: {sorted(info['unexpected_keys'])[:10]}"
        )
    missing = sorted(info["missing_keys"]) + sorted(str(m) for m in info["mismatched_keys"])
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {missing[:10]}")
    return causal_lm


def _model_config(hf_config: PretrainedConfig, model_dir: Path, dtype: torch.dtype) -> ModelConfig:
    """The shape facts the engine sizes its KV pool and limits by. Fields only the
    native modules read (rope, biases) keep neutral values: transformers computes those."""
    text = hf_config.get_text_config()
    heads = int(text.num_attention_heads)
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None  # Qwen2-style configs carry a window they do not use
    return ModelConfig(
        architecture=(hf_config.architectures or [type(hf_config).__name__])[0],
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        intermediate_size=int(getattr(text, "intermediate_size", 0) or 0),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6) or 1e-6),
        rope_theta=10000.0,
        rope_scaling=RopeScaling(),
        vocab_size=int(text.vocab_size),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 4096),
        sliding_window=int(window) if window else None,
        eos_token_ids=eos_id_union(text.eos_token_id, _generation_eos(model_dir)),
        dtype=dtype,
    )


def _generation_eos(model_dir: Path) -> Any:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
