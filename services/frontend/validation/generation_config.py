"""The model's recommended sampling defaults, from its ``generation_config.json``.

Model authors ship their preferred ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty`` there, and ``max_new_tokens`` as the output budget; vLLM (its
``--generation-config auto``, the default) and SGLang make them the defaults of every
request field left unset, and so does tokenline. ``--generation-config vllm`` (vLLM's
name for "ignore it") keeps the built-in defaults; a folder path reads that folder's file
instead of the model's. Like vLLM, ``do_sample`` is not read: a model whose file says
``do_sample: false`` still samples at its ``temperature`` unless the request says 0.
Read once at start and checked then, so a bad file stops the frontend, not each request.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingDefaults

logger = logging.getLogger(__name__)

GENERATION_CONFIG_OFF = "vllm"
GENERATION_CONFIG_AUTO = "auto"
_FILE = "generation_config.json"


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    max_new_tokens: int | None = None  # the default max_tokens, when the file sets one

    @property
    def is_empty(self) -> bool:
        return self.sampling == SamplingDefaults() and self.max_new_tokens is None


def load_generation_defaults(
    model_dir: str | Path, mode: str, vocab_size: int
) -> GenerationDefaults:
    """``mode``: ``auto`` (the model folder's file), ``vllm`` (none) or a folder path.
    Raises ValueError naming the file and field when a value is out of range."""
    if mode == GENERATION_CONFIG_OFF:
        return GenerationDefaults()
    folder = Path(model_dir) if mode == GENERATION_CONFIG_AUTO else Path(mode)
    path = folder / _FILE
    if not path.exists():
        if mode != GENERATION_CONFIG_AUTO:
            raise ValueError(f"--generation-config {mode}: no {_FILE} there")
        return GenerationDefaults()
    defaults = _from_json(json.loads(path.read_text()), path)
    _check(defaults, vocab_size, path)
    return defaults


def _from_json(raw: dict[str, object], path: Path) -> GenerationDefaults:
    values: dict[str, float | int] = {}
    for name in [*(f.name for f in fields(SamplingDefaults)), "max_new_tokens"]:
        value = raw.get(name)
        if value is None:
            continue
        whole = name in ("top_k", "max_new_tokens")
        if isinstance(value, int) and not isinstance(value, bool):
            values[name] = value if whole else float(value)
        elif isinstance(value, float) and not whole:
            values[name] = value
        else:
            kind = "an integer" if whole else "a number"
            raise ValueError(f"{path}: {name}: must be {kind}, got {value!r}")
    max_new_tokens = values.pop("max_new_tokens", None)
    return GenerationDefaults(
        SamplingDefaults(**values),  # type: ignore[arg-type]
        None if max_new_tokens is None else int(max_new_tokens),
    )


def _check(defaults: GenerationDefaults, vocab_size: int, path: Path) -> None:
    if defaults.max_new_tokens is not None and defaults.max_new_tokens < 1:
        raise ValueError(f"{path}: max_new_tokens: must be >= 1, got {defaults.max_new_tokens}")
    params = defaults.sampling.new_params()
    if defaults.max_new_tokens is not None:
        params.max_new_tokens = defaults.max_new_tokens
    try:
        params.validate(vocab_size)
    except InvalidArgumentError as exc:
        field_name = "max_new_tokens" if exc.field == "max_tokens" else exc.field
        raise ValueError(f"{path}: {field_name}: {exc.message}") from None


def log_generation_defaults(defaults: GenerationDefaults, mode: str) -> None:
    """One line at start: which defaults every request gets where it sets nothing."""
    if defaults.is_empty:
        logger.info("sampling defaults: built-in (--generation-config %s)", mode)
        return
    applied = {
        f.name: getattr(defaults.sampling, f.name)
        for f in fields(SamplingDefaults)
        if getattr(defaults.sampling, f.name) is not None
    }
    if defaults.max_new_tokens is not None:
        applied["max_tokens"] = defaults.max_new_tokens
    logger.info("sampling defaults from %s (--generation-config %s): %s", _FILE, mode, applied)
