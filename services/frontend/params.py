"""OpenAI sampling fields -> the domain SamplingParams, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass

from tokenline.v1 import openai_pb2

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams

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


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    context_length: int
    default_max_tokens: int


def params_from_openai(
    sampling: openai_pb2.OpenAISampling, max_completion_tokens: int | None = None
) -> tuple[SamplingParams, bool]:
    """Returns the params and whether the client set a token limit itself."""
    params = SamplingParams()
    for name in _SAME_NAME:
        if sampling.HasField(name):
            setattr(params, name, getattr(sampling, name))
    if sampling.HasField("min_tokens"):
        params.min_new_tokens = sampling.min_tokens
    limit = (
        max_completion_tokens
        if max_completion_tokens is not None
        else (sampling.max_tokens if sampling.HasField("max_tokens") else None)
    )
    if limit is not None:
        params.max_new_tokens = limit
    params.stop = list(sampling.stop)
    params.stop_token_ids = list(sampling.stop_token_ids)
    params.logit_bias = dict(sampling.logit_bias)
    return params, limit is not None


def finalize_params(
    params: SamplingParams, has_limit: bool, num_prompt_tokens: int, limits: ModelLimits
) -> SamplingParams:
    """Apply the context-dependent default and check everything before dispatch."""
    room = limits.context_length - num_prompt_tokens
    if room < 1:
        raise InvalidArgumentError(
            f"prompt has {num_prompt_tokens} tokens; the context length is {limits.context_length}",
            field="messages",
        )
    if not has_limit:
        params.max_new_tokens = min(room, limits.default_max_tokens)
        params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)
    params.validate(limits.vocab_size)
    if params.max_new_tokens > room:
        raise InvalidArgumentError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_new_tokens}) "
            f"exceeds the context length {limits.context_length}",
            field="max_tokens",
        )
    return params
