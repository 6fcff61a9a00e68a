"""SamplingParams as a domain type: the one place defaults and ranges live.

The proto uses ``optional`` scalars because proto3 zeros are not the real
defaults; ``from_pb`` applies defaults, ``validate`` range-checks every field
with an error that names it, ``to_pb`` writes every field explicitly so the
scheduler never re-derives a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from tokenline.v1 import common_pb2

from services.common.errors import InvalidArgumentError

TOP_K_DISABLED = -1  # 0 means the same (vLLM's spelling); both keep every token
DEFAULT_MAX_NEW_TOKENS = 128

GrammarKind = Literal["json_schema", "regex", "ebnf"]
GRAMMAR_FIELDS: tuple[GrammarKind, ...] = ("json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar's text; compile time grows with it


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's output must match: hashable, so it keys every compile cache."""

    kind: GrammarKind
    text: str


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_DISABLED
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Grammar-constrained decoding (at most one; see ``grammar``).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar the output must match; None when unconstrained (or, before
        ``validate``, when more than one is set: the first)."""
        for kind in GRAMMAR_FIELDS:
            text = getattr(self, kind)
            if text is not None:
                return GrammarSpec(kind, text)
        return None

    @classmethod
    def from_pb(
        cls, pb: common_pb2.SamplingParams, defaults: SamplingDefaults | None = None
    ) -> SamplingParams:
        """The fields ``pb`` sets; the others from ``defaults`` (the model's), then ours."""
        params = cls() if defaults is None else defaults.new_params()
        for f in fields(cls):
            if f.name in ("stop", "stop_token_ids"):
                setattr(params, f.name, list(getattr(pb, f.name)))
            elif f.name == "logit_bias":
                params.logit_bias = dict(pb.logit_bias)
            elif pb.HasField(f.name):
                setattr(params, f.name, getattr(pb, f.name))
        return params

    def to_pb(self) -> common_pb2.SamplingParams:
        pb = common_pb2.SamplingParams(
            stop=self.stop, stop_token_ids=self.stop_token_ids, logit_bias=self.logit_bias
        )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("stop", "stop_token_ids", "logit_bias") and value is not None:
                setattr(pb, f.name, value)
        return pb

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidArgumentError naming the first out-of-range field."""
        checks: list[tuple[str, bool, str]] = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= TOP_K_DISABLED, "must be -1 or 0 (off), or >= 1"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "must be in (0, 2]"),
            # 0 scores the prompt only (SGLang's max_new_tokens 0, OpenAI's echo).
            ("max_tokens", self.max_new_tokens >= 0, "must be >= 0"),
            (
                "min_tokens",
                0 <= self.min_new_tokens <= self.max_new_tokens,
                "must be in [0, max_tokens]",
            ),
            ("n", 1 <= self.n <= 64, "must be in [1, 64]"),
            ("stop", len(self.stop) <= 16 and all(self.stop), "at most 16 non-empty strings"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "must be in [0, 2^63)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidArgumentError(f"{why}, got {getattr_alias(self, name)!r}", field=name)
        self._validate_grammar()
        for token_id in [*self.stop_token_ids, *self.logit_bias]:
            if not 0 <= token_id < vocab_size:
                raise InvalidArgumentError(
                    f"token id {token_id} outside the vocabulary [0, {vocab_size})",
                    field="stop_token_ids" if token_id in self.stop_token_ids else "logit_bias",
                )
        for token_id, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise InvalidArgumentError(
                    f"bias for token {token_id} must be in [-100, 100]", field="logit_bias"
                )

    def _validate_grammar(self) -> None:
        """One grammar at most, not empty, bounded. min_tokens is refused beside a grammar:
        it would mask the very stop token a completed grammar allows, leaving no token."""
        given = [kind for kind in GRAMMAR_FIELDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise InvalidArgumentError(f"set at most one of {', '.join(given)}", field=given[1])
        for kind in given:
            text = getattr(self, kind)
            if not text.strip():
                raise InvalidArgumentError("must not be empty", field=kind)
            if len(text) > MAX_GRAMMAR_CHARS:
                raise InvalidArgumentError(
                    f"{len(text)} characters; at most {MAX_GRAMMAR_CHARS}", field=kind
                )
            if self.min_new_tokens > 0:
                raise InvalidArgumentError(
                    "cannot be combined with a grammar (the grammar decides where the output ends)",
                    field="min_tokens",
                )


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that leaves a field unset gets instead of the built-in default: the
    model's own recommendation (its generation_config.json, read by the frontend), as vLLM
    and SGLang apply it. A field left None keeps the built-in default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def new_params(self) -> SamplingParams:
        params = SamplingParams()
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                setattr(params, f.name, value)
        return params

    def to_pb(self) -> common_pb2.SamplingParams:
        """Only the fields set here (for GetInfo)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return common_pb2.SamplingParams(**{k: v for k, v in values.items() if v is not None})


_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


def getattr_alias(params: SamplingParams, name: str) -> object:
    return getattr(params, _ALIASES.get(name, name))
