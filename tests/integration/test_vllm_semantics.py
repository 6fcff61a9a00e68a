"""vLLM's small semantics through the official openai client against the real stack: an
unknown model is a 404, top_k 0 is off, stop_reason is null on EOS,
include_stop_str_in_output keeps the stop, cached_tokens counts a prompt once, the
return_token_ids lists, add_special_tokens, truncate_prompt_tokens, priority, and the
model's generation_config.json defaults (a second frontend on a copy of the model folder
that has some, sharing the first stack's scheduler and detokenizer).

The scheduler runs one request at a time, so queued requests show the priority order and
the n choices of a request run one after another (the second reads the first's KV).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.launch import LocalStack, StackPorts
from tests.live_stack import dump_logs, module_stack
from tests.waiting import wait_until

EOS = 1  # the default model's eos_token_id
USER = [{"role": "user", "content": "Tell me about the sea."}]
PROMPT = "The quick brown fox jumps over the lazy dog"
GEN_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "top_k": 1, "max_new_tokens": 5}


stack = module_stack(
    "vllm-logs",
    scheduler_args=[
        *["--kv-cache-tokens", "16384", "--num-threads", "1"],
        *["--max-running-requests", "1"],  # one at a time: the priority test reads the order
    ],
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def gen_stack(
    stack: LocalStack, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    """A frontend and gateway on a copy of the model folder whose generation_config.json
    sets top_k 1 and max_new_tokens 5, and whose tokenizer adds BOS to what it encodes
    (the default model's adds nothing: its template writes BOS); the first stack's
    scheduler and detokenizer serve it (the weights are the same: the copy links them)."""
    folder = tmp_path_factory.mktemp("genconfig") / "tokenline-tiny-genconfig"
    folder.mkdir()
    for item in default_model_dir.iterdir():
        if item.suffix == ".safetensors" or item.is_dir():  # weights, compiled kernels
            (folder / item.name).symlink_to(item)
        else:
            shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    add_bos_on_encode(folder / "tokenizer.json")
    ports = dataclasses.replace(
        StackPorts.free(), scheduler=stack.ports.scheduler, detokenizer=stack.ports.detokenizer
    )
    log_dir = tmp_path_factory.mktemp("genconfig-logs")
    second = LocalStack(str(folder), ports, log_dir=log_dir)
    try:
        second.start(only=("frontend", "gateway"))
        yield second
    except BaseException:
        dump_logs(log_dir)
        raise
    finally:
        second.stop()


def add_bos_on_encode(path: Path) -> None:
    """Give a tokenizer.json the post-processor most Llama-family tokenizers have: BOS
    before every encoded text (when add_special_tokens is on)."""
    spec = json.loads(path.read_text())
    bos = "<｜begin▁of▁sentence｜>"
    template = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}},
    }
    spec["post_processor"] = {"type": "Sequence", "processors": [spec["post_processor"], template]}
    path.write_text(json.dumps(spec))


def completion(client: openai.OpenAI, model: str, **fields: Any) -> Any:
    """A completion (of PROMPT unless ``prompt`` is given); every non-OpenAI field goes in
    the body as vLLM's."""
    known = {
        k: fields.pop(k)
        for k in ("max_tokens", "n", "seed", "stream", "temperature", "prompt")
        if k in fields
    }
    known.setdefault("max_tokens", 8)
    known.setdefault("prompt", PROMPT)
    return client.completions.create(model=model, extra_body=fields, **known)


def single_token(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    (token_id,) = tokenizer.encode(text, add_special_tokens=False)
    return token_id


# ---- the model name --------------------------------------------------------------------


def test_an_unknown_model_is_a_404_naming_the_model(
    client: openai.OpenAI, stack: LocalStack
) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=USER, max_tokens=2)
    assert "The model `no-such-model` does not exist." in err.value.message
    with pytest.raises(openai.NotFoundError):
        completion(client, "no-such-model", stream=True)
    reply = httpx.post(
        f"{stack.base_url}/completions", json={"model": "gpt-4", "prompt": "x"}, timeout=30
    )
    body = reply.json()["error"]
    assert (
        reply.status_code == 404 and body["param"] == "model" and body["type"] == "not_found_error"
    )


def test_an_empty_or_absent_model_means_the_served_one(
    client: openai.OpenAI, stack: LocalStack
) -> None:
    assert completion(client, "", max_tokens=2).choices[0].text is not None
    reply = httpx.post(
        f"{stack.base_url}/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert reply.status_code == 200


# ---- sampling fields ---------------------------------------------------------------------


def test_top_k_zero_and_minus_one_are_off_like_unset(client: openai.OpenAI, model_id: str) -> None:
    def text(**fields: Any) -> str:
        return completion(client, model_id, seed=11, ignore_eos=True, **fields).choices[0].text

    unset = text()
    assert text(top_k=0) == unset and text(top_k=-1) == unset
    assert text(top_k=1) == text(temperature=0) != unset  # a top_k that acts changes it
    with pytest.raises(openai.BadRequestError) as err:
        text(top_k=-2)
    assert err.value.body["param"] == "top_k"


def test_top_logprobs_minus_one_is_refused_by_name(client: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_id, messages=USER, logprobs=True, top_logprobs=-1
        )
    assert err.value.body["param"] == "top_logprobs" and "-1" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        completion(client, model_id, logprobs=-1)
    assert err.value.body["param"] == "logprobs"


# ---- how a choice ends -----------------------------------------------------------------


def test_stop_reason_is_null_on_eos_and_what_matched_otherwise(
    client: openai.OpenAI, model_id: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    eos = completion(client, model_id, logit_bias={str(EOS): 100}).choices[0]
    assert (eos.finish_reason, eos.stop_reason, eos.text) == ("stop", None, "")
    listed = completion(client, model_id, logit_bias={str(EOS): 100}, stop_token_ids=[EOS])
    assert listed.choices[0].stop_reason is None  # EOS even when listed, as vLLM reports it
    token = single_token(tokenizer, "hello")
    by_id = completion(client, model_id, logit_bias={str(token): 100}, stop_token_ids=[token])
    assert (by_id.choices[0].finish_reason, by_id.choices[0].stop_reason) == ("stop", token)
    by_text = completion(client, model_id, logit_bias={str(token): 100}, stop=["lo"])
    assert (by_text.choices[0].stop_reason, by_text.choices[0].text) == ("lo", "hel")
    chunks = list(
        client.chat.completions.create(
            model=model_id, messages=USER, stream=True, logit_bias={str(EOS): 100}
        )
    )
    (done,) = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert done.finish_reason == "stop" and done.stop_reason is None


@pytest.mark.parametrize("name", ["include_stop_str_in_output", "no_stop_trim"])
def test_include_stop_str_in_output_keeps_the_stop_and_streams_the_same(
    client: openai.OpenAI, model_id: str, tokenizer: PreTrainedTokenizerBase, name: str
) -> None:
    fields = {
        "logit_bias": {str(single_token(tokenizer, "hello")): 100},
        "stop": ["lo"],
        name: True,
    }
    unary = completion(client, model_id, **fields).choices[0]
    assert (unary.text, unary.stop_reason) == ("hello", "lo")
    chunks = list(completion(client, model_id, stream=True, **fields))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == unary.text
    eos = completion(
        client, model_id, logit_bias={str(EOS): 100}, skip_special_tokens=False, **{name: True}
    )
    assert eos.choices[0].text == tokenizer.decode([EOS])  # the stop token's text stays too


# ---- usage and token ids -----------------------------------------------------------------


def test_cached_tokens_count_each_prompt_once_with_n_2(
    client: openai.OpenAI, model_id: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Choice 1 of each prompt runs after choice 0 and reads its KV: summing the choices'
    cached tokens would pass prompt_tokens; each prompt counts once (its first choice)."""
    prompts = [PROMPT * 4, PROMPT * 4 + " again"]
    client.completions.create(model=model_id, prompt=prompts[0], max_tokens=1)  # cache it
    usage = client.completions.create(model=model_id, prompt=prompts, n=2, max_tokens=2).usage
    assert usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert 0 < usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    client.chat.completions.create(model=model_id, messages=USER, max_tokens=1)  # cache it
    chunks = list(
        client.chat.completions.create(
            model=model_id, messages=USER, n=2, max_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    chat_usage = chunks[-1].usage
    assert 0 < chat_usage.prompt_tokens_details.cached_tokens <= chat_usage.prompt_tokens


def test_return_token_ids_chat_unary_and_streamed(
    client: openai.OpenAI, model_id: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    fields = dict(model=model_id, messages=USER, max_tokens=8, seed=5)
    body = {"return_token_ids": True, "ignore_eos": True}
    unary = client.chat.completions.create(**fields, extra_body=body)
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert unary.model_extra["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)
    ids = unary.choices[0].model_extra["token_ids"]
    assert len(ids) == unary.usage.completion_tokens == 8
    assert tokenizer.decode(ids, skip_special_tokens=True) == unary.choices[0].message.content
    chunks = list(client.chat.completions.create(**fields, extra_body=body, stream=True))
    assert chunks[0].model_extra["prompt_token_ids"] == unary.model_extra["prompt_token_ids"]
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    streamed = [
        i for c in chunks for ch in c.choices for i in ch.model_extra.get("token_ids") or []
    ]
    assert streamed == ids
    plain = client.chat.completions.create(**fields)
    assert "prompt_token_ids" not in plain.model_extra
    assert "token_ids" not in plain.choices[0].model_extra


def test_return_token_ids_completions(
    client: openai.OpenAI, model_id: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    choice = completion(client, model_id, return_token_ids=True, ignore_eos=True).choices[0]
    assert choice.model_extra["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True) == (
        choice.text
    )
    chunks = list(
        completion(client, model_id, stream=True, return_token_ids=True, ignore_eos=True, seed=3)
    )
    unary = completion(client, model_id, return_token_ids=True, ignore_eos=True, seed=3).choices[0]
    streamed = [
        i for c in chunks for ch in c.choices for i in ch.model_extra.get("token_ids") or []
    ]
    assert streamed == unary.model_extra["token_ids"]
    firsts = [c for c in chunks if c.choices and c.choices[0].model_extra.get("prompt_token_ids")]
    assert len(firsts) == 1 and firsts[0] is chunks[0]


def test_truncate_prompt_tokens_keeps_the_last_tokens(
    client: openai.OpenAI, model_id: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    cut = completion(client, model_id, truncate_prompt_tokens=3, return_token_ids=True)
    assert cut.choices[0].model_extra["prompt_token_ids"] == tokenizer.encode(PROMPT)[-3:]
    assert cut.usage.prompt_tokens == 3
    for bad in (0, 10**6):
        with pytest.raises(openai.BadRequestError) as err:
            completion(client, model_id, truncate_prompt_tokens=bad)
        assert err.value.body["param"] == "truncate_prompt_tokens"


# ---- priority ----------------------------------------------------------------------------


def test_priority_lower_runs_first_and_a_bad_one_is_refused(
    client: openai.OpenAI, model_id: str, stack: LocalStack
) -> None:
    """One request runs; "late" (priority 5) queues first, "early" (priority -5) second;
    the scheduler admits "early" first (its scheduled stamp is the earlier one)."""
    scheduled: dict[str, float] = {}

    def run(name: str, max_tokens: int, priority: int) -> None:
        reply = client.completions.create(
            model=model_id, prompt=PROMPT, max_tokens=max_tokens,
            extra_body={"ignore_eos": True, "priority": priority},
            extra_headers={"X-Tokenline-Debug": "1"},
        )  # fmt: skip
        scheduled[name] = reply.model_extra["debug"]["times"]["scheduled"]

    threads = [threading.Thread(target=run, args=("blocker", 200, 0))]
    threads[0].start()
    wait_until(lambda: stack.scheduler_info().num_running == 1, timeout=30, what="blocker runs")
    for name, priority, waiting in (("late", 5, 1), ("early", -5, 2)):
        threads.append(threading.Thread(target=run, args=(name, 2, priority)))
        threads[-1].start()
        wait_until(lambda n=waiting: stack.scheduler_info().num_waiting == n, timeout=30, what=name)
    for thread in threads:
        thread.join(timeout=120)
    assert scheduled["blocker"] < scheduled["early"] < scheduled["late"]
    for bad in (2**40, "high"):
        with pytest.raises(openai.BadRequestError) as err:
            completion(client, model_id, priority=bad)
        assert err.value.body["param"] == "priority"


# ---- generation_config.json ----------------------------------------------------------


@pytest.fixture(scope="module")
def gen_client(gen_stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=gen_stack.base_url, api_key="unused", max_retries=0, timeout=60)


def test_generation_config_defaults_fill_unset_fields(
    client: openai.OpenAI,
    model_id: str,
    gen_client: openai.OpenAI,
    gen_stack: LocalStack,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    gen_model = gen_client.models.list().data[0].id
    assert gen_model == "tokenline-tiny-genconfig"
    ids = tokenizer.encode(PROMPT)  # as ids: the two tokenizers differ in BOS only
    # top_k 1 by default: greedy; max_new_tokens 5 is the default max_tokens.
    reply = completion(gen_client, gen_model, prompt=ids, seed=11, max_tokens=None, ignore_eos=True)
    greedy = completion(client, model_id, prompt=ids, temperature=0, max_tokens=5, ignore_eos=True)
    assert reply.usage.completion_tokens == 5 and reply.choices[0].text == greedy.choices[0].text
    # A field the request sets wins over the model's default.
    off = completion(gen_client, gen_model, prompt=ids, seed=11, ignore_eos=True, top_k=0)
    plain = completion(client, model_id, prompt=ids, seed=11, ignore_eos=True)
    assert off.choices[0].text == plain.choices[0].text != greedy.choices[0].text
    info = gen_stack.frontend_info().default_sampling
    assert (info.top_k, info.max_new_tokens, info.HasField("temperature")) == (1, 5, False)
    with pytest.raises(openai.NotFoundError):  # each frontend serves its own name
        completion(gen_client, model_id, max_tokens=1)


def test_add_special_tokens_defaults_on_for_completions_and_off_for_chat(
    gen_client: openai.OpenAI, tokenizer: PreTrainedTokenizerBase
) -> None:
    """On the frontend whose tokenizer adds BOS: completions get it unless told not to;
    chat relies on its template's BOS unless told to add the tokenizer's as well."""
    bos, plain = tokenizer.bos_token_id, tokenizer.encode(PROMPT, add_special_tokens=False)

    def prompt_ids(reply: Any, choice: bool = True) -> list[int]:
        return (reply.choices[0] if choice else reply).model_extra["prompt_token_ids"]

    model = "tokenline-tiny-genconfig"
    on = completion(gen_client, model, max_tokens=1, return_token_ids=True)
    off = completion(
        gen_client, model, max_tokens=1, return_token_ids=True, add_special_tokens=False
    )
    assert prompt_ids(on) == [bos, *plain] and prompt_ids(off) == plain
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    templated = tokenizer.encode(text, add_special_tokens=False)
    assert templated[0] == bos  # the template writes it

    def chat(**body: Any) -> list[int]:
        reply = gen_client.chat.completions.create(
            model=model, messages=USER, max_tokens=1, extra_body={"return_token_ids": True, **body}
        )
        return prompt_ids(reply, choice=False)

    assert chat() == templated and chat(add_special_tokens=True) == [bos, *templated]
