"""What the frontend must know about the model to validate a request before dispatch.

"Model stop tokens" means the ids that end a turn for this model whatever the
request says (unless it sets ``ignore_eos``): ``eos_token_id`` from config.json
and from generation_config.json (an int or a list; instruct models list their
end-of-turn tokens there) and the tokenizer's ``eos_token_id``. vLLM uses the
same union. The frontend merges them into every request's ``stop_token_ids`` so
the stop set is fixed before the request reaches a scheduler.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from services.common.eos import eos_id_union


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    context_length: int
    default_max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    # Cut a too-long prompt's left side instead of refusing it (--allow-auto-truncate).
    allow_auto_truncate: bool = False
    # --context-length was given: a cap on top of what the schedulers serve.
    context_length_is_cap: bool = False

    def served_by(self, scheduler_context_length: int) -> ModelLimits:
        """These limits with the schedulers' context length, which already counts their
        KV pool; 0 (no scheduler reported yet) keeps the model's."""
        if not scheduler_context_length:
            return self
        context = scheduler_context_length
        if self.context_length_is_cap:
            context = min(context, self.context_length)
        return dataclasses.replace(self, context_length=context)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def model_stop_token_ids(
    model_dir: str | Path, tokenizer: PreTrainedTokenizerBase
) -> tuple[int, ...]:
    """config.json eos ∪ generation_config.json eos ∪ the tokenizer's eos, in that order."""
    path = Path(model_dir)
    return eos_id_union(
        _read_json(path / "config.json").get("eos_token_id"),
        _read_json(path / "generation_config.json").get("eos_token_id"),
        tokenizer.eos_token_id,
    )


def load_model_limits(
    model_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    context_length: int = 0,
    default_max_tokens: int = 1024,
    allow_auto_truncate: bool = False,
) -> ModelLimits:
    """``context_length`` 0 means the model's ``max_position_embeddings`` until the
    schedulers report theirs (``ModelLimits.served_by``); otherwise it caps theirs."""
    config = _read_json(Path(model_dir) / "config.json")
    return ModelLimits(
        # Ids index the model's embedding table: its size is the bound, not the tokenizer's.
        vocab_size=int(config.get("vocab_size", 0)) or len(tokenizer),
        context_length=context_length or int(config.get("max_position_embeddings", 4096)),
        default_max_tokens=default_max_tokens,
        stop_token_ids=model_stop_token_ids(model_dir, tokenizer),
        allow_auto_truncate=allow_auto_truncate,
        context_length_is_cap=context_length > 0,
    )
