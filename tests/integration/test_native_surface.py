"""SGLang's /generate shape and the operator routes, over plain HTTP on the real stack.

One stack for the module: /generate (single vs batch, finish reasons, streaming),
tokenize/detokenize, version/ping, model and server info checked against each
service's own GetInfo, flush_cache, and abort_request.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.launch import LocalStack
from tests.waiting import wait_until

GREEDY = {"temperature": 0, "ignore_eos": True}
# Long enough that the prefix cache holds whole pages of it.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 12
# Far more tokens than a test waits for: only an abort ends these early.
ENDLESS = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 3000}


@pytest.fixture(scope="module")
def root(stack: LocalStack) -> str:
    return f"http://{stack.host}:{stack.ports.gateway}"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_dir)


def _generate(root: str, body: dict[str, Any], **headers: str) -> Any:
    resp = httpx.post(f"{root}/generate", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _frames(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


# ---- /generate ------------------------------------------------------------------------


def test_single_prompt_is_an_object_and_a_batch_a_list(root: str) -> None:
    sampling = GREEDY | {"max_new_tokens": 4}
    one = _generate(root, {"text": "Hello", "sampling_params": sampling}, **{"X-Request-Id": "s1"})
    assert set(one) == {"text", "output_ids", "meta_info"} and len(one["output_ids"]) == 4
    meta = one["meta_info"]
    assert meta["id"] == "s1" and meta["completion_tokens"] == 4 and meta["prompt_tokens"] > 0
    assert meta["e2e_latency"] > 0 and meta["cached_tokens"] >= 0
    assert meta["finish_reason"] == {"type": "length", "matched": None, "length": 4}

    batch = _generate(root, {"text": ["Hello", "Bye"], "sampling_params": sampling, "rid": "b"})
    assert [o["meta_info"]["id"] for o in batch] == ["b-0", "b-1"]
    assert batch[0]["output_ids"] == one["output_ids"]  # greedy: the same prompt, the same ids
    by_ids = _generate(root, {"input_ids": [[5, 6, 7]], "sampling_params": sampling})
    assert isinstance(by_ids, list) and len(by_ids) == 1
    choices = _generate(root, {"text": "Hello", "sampling_params": sampling | {"n": 2}})
    assert isinstance(choices, list) and len(choices) == 2


def test_finish_reason_names_the_stop_string_it_matched(root: str) -> None:
    body = {"text": "Once upon a time", "sampling_params": GREEDY | {"max_new_tokens": 24}}
    free = _generate(root, body)["text"]
    middle = len(free) // 2
    stop = free[middle : middle + 3]
    assert stop.strip(), f"no visible text to stop on in {free!r}"
    body["sampling_params"] |= {"stop": [stop]}
    stopped = _generate(root, body)
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == free[: free.index(stop)]


def test_stream_frames_carry_the_output_so_far_then_done(root: str) -> None:
    body = {"text": "Hello there", "sampling_params": GREEDY | {"max_new_tokens": 12}}
    whole = _generate(root, body)
    resp = httpx.post(f"{root}/generate", json=body | {"stream": True}, timeout=120)
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames = list(_frames(iter(resp.text.splitlines())))
    assert frames[-1] == "[DONE]" and len(frames) > 2
    outputs = [json.loads(f) for f in frames[:-1]]
    texts = [o["text"] for o in outputs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert [o["meta_info"]["finish_reason"] for o in outputs[:-1]] == [None] * (len(outputs) - 1)
    last = outputs[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


# ---- tokenize, version, ping, info ----------------------------------------------------


def test_tokenize_messages_with_token_strs_and_detokenize_round_trip(
    root: str, tokenizer: PreTrainedTokenizerBase, stack: LocalStack
) -> None:
    messages = [{"role": "user", "content": "Tokenize me, please."}]
    body = {"messages": messages, "return_token_strs": True}
    got = httpx.post(f"{root}/tokenize", json=body, timeout=30).json()
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert got["tokens"] == list(expected) and got["count"] == len(expected)
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    assert got["max_model_len"] == stack.scheduler_info().context_length
    without = body | {"add_generation_prompt": False}
    shorter = httpx.post(f"{root}/v1/tokenize", json=without, timeout=30).json()["tokens"]
    assert len(shorter) < len(got["tokens"])  # the /v1 path runs the same implementation

    text = httpx.post(f"{root}/detokenize", json={"tokens": got["tokens"]}, timeout=30).json()
    assert text["prompt"] == tokenizer.decode(got["tokens"])
    plain = httpx.post(f"{root}/tokenize", json={"prompt": "Tokenize me"}, timeout=30).json()
    assert plain["tokens"] == tokenizer.encode("Tokenize me") and "token_strs" not in plain

    refused = httpx.post(f"{root}/tokenize", json=body | {"add_special_tokens": True}, timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "add_special_tokens"


def test_version_and_ping(root: str) -> None:
    version = httpx.get(f"{root}/version", timeout=10).json()
    assert version == {"version": importlib.metadata.version("tokenline")}
    assert httpx.get(f"{root}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{root}/ping", timeout=10).status_code == 200


def test_model_and_server_info_match_each_services_own_get_info(
    root: str, stack: LocalStack
) -> None:
    scheduler = stack.scheduler_info()
    model = httpx.get(f"{root}/get_model_info", timeout=10).json()
    served = httpx.get(f"{root}/v1/models", timeout=10).json()["data"][0]["id"]
    assert model["is_generation"] is True and model["model_path"] == stack.model
    assert model["served_model_name"] == served == scheduler.model
    assert model["max_model_len"] == scheduler.context_length and model["dtype"] == scheduler.dtype
    assert model["architecture"] == scheduler.architecture == "LlamaForCausalLM"
    assert model["model_impl"] == scheduler.model_impl == "native"

    info = httpx.get(f"{root}/get_server_info", timeout=10).json()
    assert info["version"] == importlib.metadata.version("tokenline") and info["model"] == model
    assert info["frontend"]["info"]["frontend_id"] == stack.frontend_info().frontend_id
    (replica,) = info["schedulers"]
    assert replica["address"] == stack.addr("scheduler") and replica["is_leased"] is True
    assert replica["info"]["context_length"] == scheduler.context_length
    assert replica["info"]["num_total_kv_tokens"] == scheduler.num_total_kv_tokens
    assert info["detokenizer"]["address"] == stack.addr("detokenizer")
    assert (
        info["detokenizer"]["info"]["num_subscribers"] == stack.detokenizer_info().num_subscribers
    )
    # Each scrape target is the service's own Prometheus endpoint.
    for name, entry in (
        ("frontend", info["frontend"]),
        ("scheduler", replica),
        ("detokenizer", info["detokenizer"]),
        ("gateway", info["gateway"]),
    ):
        assert f"http://{entry['metrics']}/metrics" == stack.ports.metrics_url(name), name
    scraped = httpx.get(f"http://{replica['metrics']}/metrics", timeout=10).text
    assert "tokenline:num_requests_running" in scraped


# ---- flush and abort ------------------------------------------------------------------


def test_flush_cache_empties_the_prefix_cache(root: str) -> None:
    body = {"text": LONG_PROMPT, "sampling_params": GREEDY | {"max_new_tokens": 2}}
    _generate(root, body)
    again = _generate(root, body)["meta_info"]
    assert again["cached_tokens"] > 0, "a repeated prompt should hit the prefix cache"
    resp = httpx.post(f"{root}/flush_cache", timeout=60)
    assert resp.status_code == 200 and resp.json()["success"] is True
    assert _generate(root, body)["meta_info"]["cached_tokens"] == 0


def test_abort_by_label_ends_the_stream_and_flush_is_refused_meanwhile(
    root: str, stack: LocalStack
) -> None:
    body = {"text": "Tell me a story", "sampling_params": ENDLESS, "stream": True}
    headers = {"X-Request-Id": "endless-1"}
    with httpx.stream("POST", f"{root}/generate", json=body, headers=headers, timeout=120) as resp:
        frames = _frames(resp.iter_lines())
        first = json.loads(next(frames))
        assert first["meta_info"]["id"] == "endless-1"
        busy = httpx.post(f"{root}/flush_cache", timeout=60)
        assert busy.status_code == 400 and busy.json()["error"]["code"] == "requests_in_flight"
        aborted = httpx.post(f"{root}/abort_request", json={"rid": "endless-1"}, timeout=30)
        assert aborted.status_code == 200 and aborted.json() == {"num_aborted": 1}
        rest = list(frames)
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])["meta_info"]
    assert last["finish_reason"]["type"] == "abort"
    assert last["completion_tokens"] < ENDLESS["max_new_tokens"]
    _serves_again(root, stack)


def test_abort_all_ends_every_request_of_a_batch(root: str, stack: LocalStack) -> None:
    body = {"text": ["One", "Two"], "sampling_params": ENDLESS, "stream": True}
    with httpx.stream("POST", f"{root}/generate", json=body, timeout=120) as resp:
        frames = _frames(resp.iter_lines())
        next(frames)
        aborted = httpx.post(f"{root}/abort_request", json={"abort_all": True}, timeout=30)
        assert aborted.json() == {"num_aborted": 2}
        outputs = [json.loads(f) for f in frames if f != "[DONE]"]
    ends = {
        o["index"]: o["meta_info"]["finish_reason"]
        for o in outputs
        if o["meta_info"]["finish_reason"]
    }
    assert {i: r["type"] for i, r in ends.items()} == {0: "abort", 1: "abort"}
    refused = httpx.post(f"{root}/abort_request", json={}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "rid"
    _serves_again(root, stack)


def _serves_again(root: str, stack: LocalStack) -> None:
    """Every service let go of the aborted requests, and a new one runs to the end."""
    wait_until(lambda: not any(stack.live_state().values()), timeout=10)
    after = _generate(
        root, {"text": "Still there?", "sampling_params": GREEDY | {"max_new_tokens": 3}}
    )
    assert after["meta_info"]["finish_reason"]["type"] == "length"
