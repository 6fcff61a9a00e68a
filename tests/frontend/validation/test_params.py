"""Sampling validation, context fitting and stop merging, before anything is dispatched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from tokenline.v1 import common_pb2, openai_pb2
from transformers import PreTrainedTokenizerBase

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingDefaults
from services.frontend.validation.limits import ModelLimits, load_model_limits, model_stop_token_ids
from services.frontend.validation.params import (
    check_sampling,
    fit_prompt,
    params_from_native,
    params_from_openai,
)

LIMITS = ModelLimits(
    vocab_size=1000, context_length=100, default_max_tokens=30, stop_token_ids=(1, 7)
)

# (OpenAI field, bad value). Every range SamplingParams.validate enforces, at both ends.
INVALID_OPENAI = [
    ("temperature", -0.5),
    ("temperature", 101.0),
    ("temperature", "NaN"),
    ("top_p", "NaN"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 2.5),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("min_tokens", -1),
    ("n", 0),
    ("n", 65),
    ("seed", -1),
    ("stop", [""]),
    ("stop", [f"s{i}" for i in range(17)]),
    ("stop_token_ids", [10**7]),
    ("stop_token_ids", [-1]),
    ("logit_bias", {"10000000": 1.0}),
    ("logit_bias", {"5": 101.0}),
]


def openai_sampling(**fields: Any) -> openai_pb2.OpenAISampling:
    return json_format.ParseDict(fields, openai_pb2.OpenAISampling())


@pytest.mark.parametrize(("field", "value"), INVALID_OPENAI)
def test_every_invalid_openai_field_is_named(field: str, value: Any) -> None:
    requested = params_from_openai(openai_sampling(**{field: value}))
    with pytest.raises(InvalidArgumentError) as err:
        check_sampling(requested, LIMITS)
    assert err.value.field == field


def test_min_tokens_above_max_tokens_is_named() -> None:
    requested = params_from_openai(openai_sampling(max_tokens=5, min_tokens=6))
    with pytest.raises(InvalidArgumentError) as err:
        check_sampling(requested, LIMITS)
    assert err.value.field == "min_tokens"


def test_max_completion_tokens_wins_and_is_named_in_errors() -> None:
    requested = params_from_openai(openai_sampling(max_tokens=5), max_completion_tokens=9)
    assert requested.params.max_new_tokens == 9
    bad = params_from_openai(openai_sampling(max_tokens=5), max_completion_tokens=0)
    with pytest.raises(InvalidArgumentError) as err:
        check_sampling(bad, LIMITS)
    assert err.value.field == "max_completion_tokens"


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_new_tokens", -1), ("min_new_tokens", -1), ("temperature", -1.0), ("top_k", -2)],
)
def test_native_fields_are_named_as_the_native_api_spells_them(field: str, value: Any) -> None:
    requested = params_from_native(common_pb2.SamplingParams(**{field: value}))
    with pytest.raises(InvalidArgumentError) as err:
        check_sampling(requested, LIMITS)
    assert err.value.field == field


def test_prompt_plus_max_tokens_over_the_context_names_max_tokens() -> None:
    requested = params_from_openai(openai_sampling(max_tokens=50))
    with pytest.raises(InvalidArgumentError) as err:
        fit_prompt(requested, list(range(60)), LIMITS, "messages")
    assert err.value.field == "max_tokens" and "100" in err.value.message


def test_a_prompt_alone_over_the_context_names_the_prompt_field() -> None:
    requested = params_from_openai(openai_sampling())
    with pytest.raises(InvalidArgumentError) as err:
        fit_prompt(requested, list(range(100)), LIMITS, "prompt")
    assert err.value.field == "prompt"


def test_without_a_limit_the_default_is_capped_by_the_room_left() -> None:
    requested = params_from_openai(openai_sampling())
    assert fit_prompt(requested, list(range(10)), LIMITS, "prompt").params.max_new_tokens == 30
    assert fit_prompt(requested, list(range(90)), LIMITS, "prompt").params.max_new_tokens == 10


def test_auto_truncate_cuts_the_left_side_of_the_prompt() -> None:
    limits = ModelLimits(1000, 100, 30, allow_auto_truncate=True)
    prompt = list(range(200, 290))
    fitted = fit_prompt(params_from_openai(openai_sampling(max_tokens=40)), prompt, limits, "p")
    assert fitted.input_ids == prompt[-60:] and fitted.num_truncated == 30
    assert fitted.params.max_new_tokens == 40
    # No limit and a prompt longer than the context: room for the default is made.
    fitted = fit_prompt(params_from_openai(openai_sampling()), list(range(150)), limits, "p")
    assert fitted.input_ids == list(range(150))[-70:] and fitted.params.max_new_tokens == 30
    # max_tokens alone fills the context: nothing can be kept.
    with pytest.raises(InvalidArgumentError) as err:
        fit_prompt(params_from_openai(openai_sampling(max_tokens=100)), prompt, limits, "p")
    assert err.value.field == "max_tokens"


def test_model_stop_tokens_are_merged_unless_ignore_eos() -> None:
    requested = params_from_openai(openai_sampling(stop_token_ids=[7, 9], stop=["a", "a", "b"]))
    params = fit_prompt(requested, [5, 6], LIMITS, "prompt").params
    assert params.stop_token_ids == [7, 9, 1]
    assert params.stop == ["a", "b"]
    ignoring = params_from_openai(openai_sampling(stop_token_ids=[9], ignore_eos=True))
    assert fit_prompt(ignoring, [5], LIMITS, "prompt").params.stop_token_ids == [9]


def test_model_stop_tokens_come_from_config_generation_config_and_tokenizer(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5, "vocab_size": 10}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9, 11]}))
    ids = model_stop_token_ids(tmp_path, tokenizer)
    assert ids == (5, 9, 11, tokenizer.eos_token_id)
    limits = load_model_limits(tmp_path, tokenizer, context_length=64)
    assert limits.vocab_size == 10 and limits.context_length == 64


def test_the_default_model_stops_on_its_eos(default_model_dir: Path, tokenizer) -> None:
    limits = load_model_limits(default_model_dir, tokenizer)
    assert limits.stop_token_ids == (tokenizer.eos_token_id,)
    assert limits.context_length == 4096


def test_the_schedulers_context_length_is_the_source_and_the_flag_only_caps_it(
    default_model_dir: Path, tokenizer
) -> None:
    model = load_model_limits(default_model_dir, tokenizer)  # 4096 from config.json
    assert model.served_by(0).context_length == 4096  # no scheduler reported yet
    assert model.served_by(1024).context_length == 1024  # e.g. a small KV pool
    assert model.served_by(8192).context_length == 8192  # the scheduler's override
    capped = load_model_limits(default_model_dir, tokenizer, context_length=2048)
    assert capped.served_by(1024).context_length == 1024
    assert capped.served_by(8192).context_length == 2048


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_and_minus_one_both_mean_off(top_k: int) -> None:
    """vLLM spells "no top-k" as 0 (and accepts -1); the sampler keeps every token for both."""
    requested = params_from_openai(openai_sampling(top_k=top_k))
    check_sampling(requested, LIMITS)
    assert requested.params.top_k == top_k and not requested.params.is_greedy


def test_the_models_defaults_fill_only_the_fields_a_request_leaves_unset() -> None:
    defaults = SamplingDefaults(temperature=0.6, top_k=20, repetition_penalty=1.1)
    requested = params_from_openai(openai_sampling(temperature=0.9), defaults=defaults)
    params = requested.params
    assert (params.temperature, params.top_k, params.repetition_penalty) == (
        pytest.approx(0.9),
        20,
        pytest.approx(1.1),
    )
    assert params.top_p == 1.0  # not in the defaults: the built-in one
    native = params_from_native(common_pb2.SamplingParams(top_k=5), defaults).params
    assert (native.top_k, native.temperature) == (5, pytest.approx(0.6))


def test_truncate_prompt_tokens_keeps_the_last_n_tokens() -> None:
    prompt = list(range(200, 260))
    requested = params_from_openai(openai_sampling(max_tokens=10))
    requested.truncate_prompt_tokens = 25
    fitted = fit_prompt(requested, prompt, LIMITS, "prompt")
    assert fitted.input_ids == prompt[-25:] and fitted.num_truncated == 35
    requested.truncate_prompt_tokens = -1  # as many as fit beside max_tokens
    assert (
        fit_prompt(requested, list(range(200)), LIMITS, "prompt").input_ids
        == list(range(200))[-90:]
    )
    requested.truncate_prompt_tokens = 80  # more than the prompt has: kept whole
    assert fit_prompt(requested, prompt, LIMITS, "prompt").num_truncated == 0
    requested.truncate_prompt_tokens = 91  # more than the context leaves beside max_tokens
    with pytest.raises(InvalidArgumentError) as err:
        fit_prompt(requested, prompt, LIMITS, "prompt")
    assert err.value.field == "truncate_prompt_tokens" and "90" in err.value.message


@pytest.mark.parametrize("bad", [0, -2])
def test_truncate_prompt_tokens_must_be_minus_one_or_positive(bad: int) -> None:
    requested = params_from_openai(openai_sampling())
    requested.truncate_prompt_tokens = bad
    with pytest.raises(InvalidArgumentError) as err:
        check_sampling(requested, LIMITS)
    assert err.value.field == "truncate_prompt_tokens"


def test_priority_is_vllms_lower_first_and_must_negate_within_int32() -> None:
    requested = params_from_openai(openai_sampling())
    requested.priority = -5  # vLLM: earlier than the default 0
    check_sampling(requested, LIMITS)
    assert requested.scheduler_priority == 5  # the scheduler runs higher first
    requested.priority = -(2**31)
    with pytest.raises(InvalidArgumentError) as err:
        check_sampling(requested, LIMITS)
    assert err.value.field == "priority"


def test_zero_tokens_only_where_the_api_scores_prompts() -> None:
    # OpenAI and vLLM refuse max_tokens 0 except for an echoed completion; SGLang takes
    # max_new_tokens 0 natively. Both then score the prompt and generate nothing.
    openai_zero = params_from_openai(openai_sampling(max_tokens=0))
    with pytest.raises(InvalidArgumentError) as err:
        check_sampling(openai_zero, LIMITS)
    assert err.value.field == "max_tokens" and ">= 1" in err.value.message
    openai_zero.min_limit = 0  # what completions set for echo
    check_sampling(openai_zero, LIMITS)
    assert fit_prompt(openai_zero, [5, 6], LIMITS, "prompt").params.max_new_tokens == 0
    native = params_from_native(common_pb2.SamplingParams(max_new_tokens=0))
    check_sampling(native, LIMITS)
