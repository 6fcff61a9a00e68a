"""Request sampling fields -> validated SamplingParams that fit the context.

Two steps, both before anything is dispatched: ``check_sampling`` range-checks
every field as soon as the request arrives (before templating or tokenizing);
``fit_prompt`` runs once the prompt's length is known and either fits prompt +
max_tokens into the context, cuts the prompt's left side (--allow-auto-truncate),
or refuses. Errors name the field the way the client's API spells it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenline.v1 import common_pb2, openai_pb2

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingDefaults, SamplingParams
from services.frontend.validation.limits import ModelLimits
from services.frontend.validation.structured_output import apply_openai_structured_output

MAX_PRIORITY = 2**31 - 1  # int32 on the wire, and its negation must be one too

_SAME_NAME = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "seed",
    "n",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
)


@dataclass(slots=True)
class RequestedParams:
    """What the client asked for, before the prompt is known."""

    params: SamplingParams
    # The field that set the token limit ("max_tokens", "max_completion_tokens",
    # "max_new_tokens"), or None when the server default applies.
    limit_field: str | None
    # How this API spells the fields SamplingParams.validate reports.
    aliases: dict[str, str]
    # The least token limit the API takes: 0 (score the prompt, generate nothing) only
    # natively and for an echoed completion, as vLLM and SGLang allow it.
    min_limit: int = 1
    # vLLM's truncate_prompt_tokens: keep the prompt's last N tokens (-1: as many as fit).
    truncate_prompt_tokens: int | None = None
    # vLLM's priority: lower runs earlier. The scheduler orders higher first (SGLang's
    # way, and the native API's), so ``scheduler_priority`` is its negation.
    priority: int = 0

    @property
    def scheduler_priority(self) -> int:
        return -self.priority


@dataclass(slots=True)
class FittedPrompt:
    input_ids: list[int]
    params: SamplingParams
    num_truncated: int = 0


def params_from_openai(
    sampling: openai_pb2.OpenAISampling,
    max_completion_tokens: int | None = None,
    defaults: SamplingDefaults | None = None,
) -> RequestedParams:
    """OpenAI fields; ``max_completion_tokens`` wins over ``max_tokens`` when both are set.
    Structured output (response_format, structured_outputs, guided_*) becomes the grammar.
    A field left unset takes the model's default (``defaults``), else the built-in one."""
    params = SamplingParams() if defaults is None else defaults.new_params()
    for name in _SAME_NAME:
        if sampling.HasField(name):
            setattr(params, name, getattr(sampling, name))
    if sampling.HasField("min_tokens"):
        params.min_new_tokens = sampling.min_tokens
    limit_field = None
    if max_completion_tokens is not None:
        params.max_new_tokens, limit_field = max_completion_tokens, "max_completion_tokens"
    elif sampling.HasField("max_tokens"):
        params.max_new_tokens, limit_field = sampling.max_tokens, "max_tokens"
    params.stop = list(sampling.stop)
    params.stop_token_ids = list(sampling.stop_token_ids)
    params.logit_bias = dict(sampling.logit_bias)
    aliases = {"max_tokens": limit_field or "max_tokens"}
    apply_openai_structured_output(params, aliases, sampling)
    return RequestedParams(params, limit_field, aliases)


def params_from_native(
    pb: common_pb2.SamplingParams, defaults: SamplingDefaults | None = None
) -> RequestedParams:
    limit_field = "max_new_tokens" if pb.HasField("max_new_tokens") else None
    aliases = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
    params = SamplingParams.from_pb(pb, defaults)
    return RequestedParams(params, limit_field, aliases, min_limit=0)


def check_sampling(requested: RequestedParams, limits: ModelLimits) -> None:
    """Range-check every field now; the token limit is checked against the
    context later, when the prompt's length is known."""
    probe = _copy(requested.params)
    if requested.limit_field is None:
        probe.max_new_tokens = max(probe.min_new_tokens, 1)
    _validate(probe, requested, limits)
    if abs(requested.priority) > MAX_PRIORITY:
        raise InvalidArgumentError(
            f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {requested.priority}",
            field="priority",
        )
    keep = requested.truncate_prompt_tokens
    if keep is not None and not (keep == -1 or keep >= 1):
        raise InvalidArgumentError(
            f"must be -1 (as many as fit) or >= 1, got {keep}", field="truncate_prompt_tokens"
        )


def fit_prompt(
    requested: RequestedParams, input_ids: list[int], limits: ModelLimits, prompt_field: str
) -> FittedPrompt:
    """Final params for one prompt: token limit set, model stops merged, context respected."""
    params = _copy(requested.params)
    input_ids, num_cut = _truncate_prompt(requested, input_ids, limits.context_length)
    ids, num_truncated = _fit_context(requested, params, input_ids, limits, prompt_field)
    num_truncated += num_cut
    _validate(params, requested, limits)
    merge_stops(params, limits.stop_token_ids)
    return FittedPrompt(ids, params, num_truncated)


def merge_stops(params: SamplingParams, model_stop_ids: tuple[int, ...]) -> None:
    """Request stops, de-duplicated, plus the model's stop tokens unless ignore_eos."""
    params.stop = list(dict.fromkeys(params.stop))
    extra = () if params.ignore_eos else model_stop_ids
    params.stop_token_ids = list(dict.fromkeys([*params.stop_token_ids, *extra]))


def _truncate_prompt(
    requested: RequestedParams, ids: list[int], context: int
) -> tuple[list[int], int]:
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens. N may not exceed what the
    context leaves beside max_tokens (unset: 1); -1 is exactly that much."""
    keep = requested.truncate_prompt_tokens
    if keep is None:
        return ids, 0
    limit_field = requested.limit_field
    room = context - (requested.params.max_new_tokens if limit_field else 1)
    if keep > room:
        room_of = f"the context length {context} - {limit_field or 'one output token'}"
        raise InvalidArgumentError(
            f"{keep} is more than {room_of} = {room}", field="truncate_prompt_tokens"
        )
    keep = room if keep == -1 else keep
    if keep < 1:  # -1 with a max_tokens that fills the context: _fit_context refuses it
        return ids, 0
    return ids[-keep:], max(len(ids) - keep, 0)


def _fit_context(
    requested: RequestedParams,
    params: SamplingParams,
    ids: list[int],
    limits: ModelLimits,
    prompt_field: str,
) -> tuple[list[int], int]:
    context = limits.context_length
    if requested.limit_field is None:
        # Server default: as many as fit, at most default_max_tokens.
        room = context - len(ids)
        want = max(min(limits.default_max_tokens, context - 1), params.min_new_tokens, 1)
        params.max_new_tokens = min(want, max(room, 0))
        if room >= max(params.min_new_tokens, 1):
            return ids, 0
        params.max_new_tokens = want
    elif len(ids) + params.max_new_tokens <= context:
        return ids, 0
    keep = context - params.max_new_tokens
    if limits.allow_auto_truncate and keep >= 1:
        return ids[-keep:], len(ids) - keep
    if requested.limit_field is None or len(ids) >= context:
        raise InvalidArgumentError(
            f"the prompt has {len(ids)} tokens; the context length is {context}",
            field=prompt_field,
        )
    raise InvalidArgumentError(
        f"prompt ({len(ids)} tokens) + {requested.limit_field} ({params.max_new_tokens}) "
        f"exceeds the context length {context}",
        field=requested.limit_field,
    )


def _validate(params: SamplingParams, requested: RequestedParams, limits: ModelLimits) -> None:
    if 0 <= params.max_new_tokens < requested.min_limit:
        limit = requested.aliases.get("max_tokens", "max_tokens")
        raise InvalidArgumentError(
            f"must be >= {requested.min_limit}, got {params.max_new_tokens}", field=limit
        )
    try:
        params.validate(limits.vocab_size)
    except InvalidArgumentError as exc:
        field = requested.aliases.get(exc.field or "", exc.field)
        message = exc.message.replace("max_tokens", requested.aliases.get("max_tokens", ""))
        raise InvalidArgumentError(message, field=field) from None


def _copy(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(
        params,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        logit_bias=dict(params.logit_bias),
    )
