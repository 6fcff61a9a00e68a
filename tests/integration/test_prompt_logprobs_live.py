"""Prompt logprobs through the real stack: log-likelihood scoring as lm-eval's
``local-completions`` does it (``echo``, ``logprobs``, ``max_tokens: 0``) with the official
openai client, vLLM's ``prompt_logprobs`` on completions and chat, and the native gRPC
Generate with ``logprob_start_len`` 0. All three must give the same numbers for the same
prompt: one scheduler computes them the same way (a fresh prefill from position 0).
Their agreement with HF transformers is tests/scheduler/sampling/test_prompt_logprobs.py's job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from tokenline.v1 import common_pb2, frontend_pb2_grpc, generate_pb2, openai_pb2
from transformers import AutoTokenizer

from services.common.errors import field_of
from services.common.tls import open_sync_channel
from services.launch import LocalStack

PROMPT = "The quick brown fox jumps over the lazy dog, and then it naps."
MESSAGES = [{"role": "user", "content": "Score this sentence, please."}]
SAME = 1e-4  # one scheduler, one prefill path: equal up to float noise
TOP = 2


@pytest.fixture(scope="module")
def frontend(stack: LocalStack) -> Any:
    with open_sync_channel(stack.addr("frontend"), stack.tls) as channel:
        yield frontend_pb2_grpc.FrontendServiceStub(channel)


def native_scores(frontend: Any, ids: list[int]) -> list[common_pb2.TokenLogprob]:
    request = generate_pb2.GenerateReqInput(
        input_ids=[openai_pb2.TokenIds(ids=ids)],
        sampling_params=common_pb2.SamplingParams(max_new_tokens=0),
        logprob=common_pb2.LogprobOptions(
            return_logprob=True, top_logprobs_num=TOP, logprob_start_len=0
        ),
    )
    out = frontend.Generate(request, timeout=60).outputs[0]
    assert out.meta_info.completion_tokens == 0 and not out.output_ids
    return list(out.input_token_logprobs)


def assert_vllm_entries(entries: list[Any], ids: list[int], native: list[Any]) -> None:
    """vLLM's prompt_logprobs shape, holding the native API's numbers."""
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry, want = entries[pos], native[pos]
        mine = entry[str(ids[pos])]
        assert abs(mine["logprob"] - want.logprob) < SAME and mine["rank"] == want.rank
        assert isinstance(mine["decoded_token"], str)
        tops = {str(t.token_id): t.logprob for t in want.top}
        assert set(entry) == tops.keys() | {str(ids[pos])}
        for key, value in tops.items():
            assert abs(entry[key]["logprob"] - value) < SAME


def test_echo_scoring_equals_prompt_logprobs_and_native(
    client: openai.OpenAI, model_id: str, frontend: Any
) -> None:
    scored = client.completions.create(
        model=model_id, prompt=PROMPT, echo=True, logprobs=TOP, max_tokens=0
    )
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.tokens) == scored.usage.prompt_tokens

    asked = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": TOP}
    )
    ids = _prompt_ids(frontend, PROMPT)
    native = native_scores(frontend, ids)
    assert [e.token_id for e in native] == ids and native[0].no_logprob
    assert not native[0].HasField("rank") and native[1].HasField("rank")
    assert_vllm_entries(asked.choices[0].model_extra["prompt_logprobs"], ids, native)
    for pos in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[pos] - native[pos].logprob) < SAME
        assert len(logprobs.top_logprobs[pos]) == TOP


def _prompt_ids(frontend: Any, text: str) -> list[int]:
    """The ids a completion prompt runs with: the native API's own tokenization."""
    request = generate_pb2.GenerateReqInput(
        text=[text],
        sampling_params=common_pb2.SamplingParams(max_new_tokens=0),
        logprob=common_pb2.LogprobOptions(return_logprob=True, logprob_start_len=0),
    )
    out = frontend.Generate(request, timeout=60).outputs[0]
    return [e.token_id for e in out.input_token_logprobs]


def test_chat_prompt_logprobs_match_native(
    client: openai.OpenAI, model_id: str, frontend: Any, default_model_dir: Path
) -> None:
    resp = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": TOP}
    )
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(ids)
    assert_vllm_entries(resp.model_extra["prompt_logprobs"], ids, native_scores(frontend, ids))


def test_streamed_echo_carries_the_prompt_logprobs_first(
    client: openai.OpenAI, model_id: str
) -> None:
    kwargs: dict[str, Any] = dict(
        model=model_id, prompt=PROMPT, echo=True, logprobs=1, max_tokens=2, temperature=0
    )
    chunks = list(client.completions.create(**kwargs, stream=True))
    values = [v for c in chunks if c.choices and c.choices[0].logprobs
              for v in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    whole = client.completions.create(**kwargs)
    assert values[0] is None and len(values) == len(whole.choices[0].logprobs.token_logprobs)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),  # vLLM too: 0 only with echo
    ],
)
def test_bad_values_are_refused_by_name(
    client: openai.OpenAI, model_id: str, fields: dict[str, Any], param: str
) -> None:
    body = {"model": model_id, "prompt": PROMPT, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/completions", body=body, cast_to=object)
    assert err.value.body["param"] == param  # type: ignore[index]


def test_native_start_past_the_prompt_is_refused(frontend: Any) -> None:
    request = generate_pb2.GenerateReqInput(
        input_ids=[openai_pb2.TokenIds(ids=[0, 5, 6])],
        logprob=common_pb2.LogprobOptions(return_logprob=True, logprob_start_len=3),
    )
    with pytest.raises(grpc.RpcError) as err:
        frontend.Generate(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(err.value) == "logprob_start_len"  # type: ignore[arg-type]
