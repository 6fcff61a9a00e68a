"""The gateway against the REAL stack: official openai client (sync and async), raw SSE
bytes, native routes, errors from the real frontend, auth/limits/deadline, disconnects.

One LocalStack (detokenizer, scheduler, frontend, gateway as subprocesses) serves the
module; every assertion compares against what the real services computed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gateway_harness import GatewayServer
from live_helpers import (
    scheduler_load,
    sse_frames,
)
from test_gateway_openapi import validator
from transformers import AutoTokenizer

from gateway.config import GatewayConfig
from services.launch import LocalStack
from tests.live_stack import finish_counts, wait_for_finishes
from tests.waiting import eventually

USER = [{"role": "user", "content": "Name three colours, please."}]
PROMPT = "The quick brown fox"
# Long enough that a request is still decoding when the test cancels it.
LONG = {"max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(autouse=True)
def fake() -> None:
    """The real frontend answers here: override the suite's autouse fake-frontend reset."""


# ``stack``: the module's own live stack (tests/conftest.py).


@pytest.fixture(scope="module")
def root(stack: LocalStack) -> str:
    return f"http://{stack.host}:{stack.ports.gateway}"


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
async def async_client(stack: LocalStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def greedy_text(client: openai.OpenAI, model_id: str) -> str:
    """24 greedy tokens after PROMPT: the reference the stop tests cut."""
    out = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


# ---- openai client, sync -------------------------------------------------------------


def test_models_list_and_retrieve(
    client: openai.OpenAI, model_id: str, default_model_dir: Path, stack: LocalStack
) -> None:
    assert model_id == default_model_dir.name
    model = client.models.retrieve(model_id)
    assert (model.id, model.object, model.owned_by) == (model_id, "model", "tokenline")
    # The card carries the dtype the scheduler reports: the shared stack's explicit float32
    # (`auto` is checked on test_limits.py's stack).
    assert stack.scheduler_info().dtype == "float32"
    assert model.to_dict()["dtype"] == client.models.list().data[0].to_dict()["dtype"] == "float32"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.status_code == 404 and info.value.param == "model"


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI, model_id: str) -> None:
    out = client.chat.completions.create(
        model=model_id,
        messages=USER,
        max_tokens=20,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_content_parts_equal_plain_content(client: openai.OpenAI, model_id: str) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": USER[0]["content"]}]}]
    kwargs = dict(model=model_id, max_tokens=8, temperature=0)
    # Warm the prefix cache first so both requests below see the same cache state.
    client.chat.completions.create(messages=USER, **kwargs)
    plain = client.chat.completions.create(messages=USER, **kwargs)
    as_parts = client.chat.completions.create(messages=parts, **kwargs)
    assert as_parts.choices[0].message.content == plain.choices[0].message.content
    assert as_parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_n2_stream_matches_non_stream_per_choice(client: openai.OpenAI, model_id: str) -> None:
    kwargs = dict(model=model_id, messages=USER, n=2, max_tokens=6, temperature=1.0, seed=7)
    full = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    texts, finishes, roles = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] += [choice.delta.role] if choice.delta.role else []
            finishes[choice.index] += [choice.finish_reason] if choice.finish_reason else []
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finishes == {0: ["length"], 1: ["length"]}
    assert roles == {0: ["assistant"], 1: ["assistant"]}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_seed_reproduces_at_temperature_one(client: openai.OpenAI, model_id: str) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=model_id, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


@pytest.mark.parametrize("as_list", [False, True], ids=["string", "list"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_stop_ends_the_text_before_the_match(
    client: openai.OpenAI, model_id: str, greedy_text: str, as_list: bool, stream: bool
) -> None:
    middle = len(greedy_text) // 2
    stop = greedy_text[middle : middle + 3]
    expected = greedy_text[: greedy_text.index(stop)]
    kwargs: dict[str, Any] = dict(
        model=model_id,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=["never-in-this-text", stop] if as_list else stop,
        extra_body={"ignore_eos": True},
    )
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert finish == ["stop"]
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text = choice.text
        assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert text == expected


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, model_id: str) -> None:
    kwargs = dict(model=model_id, messages=USER, max_tokens=6, temperature=0, logprobs=True)
    out = client.chat.completions.create(**kwargs, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for entry in entries:
        top = entry.top_logprobs
        assert len(top) == 3 and [t.logprob for t in top] == sorted(
            (t.logprob for t in top), reverse=True
        )
        # Greedy: the chosen token is the most likely one.
        assert (entry.token, entry.logprob) == (top[0].token, top[0].logprob) and entry.logprob <= 0
    joined = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")
    assert joined == out.choices[0].message.content
    streamed = [
        e.token
        for c in client.chat.completions.create(**kwargs, stream=True)
        for ch in c.choices
        if ch.logprobs
        for e in ch.logprobs.content
    ]
    assert streamed == [e.token for e in entries]


def test_completion_logprobs(client: openai.OpenAI, model_id: str) -> None:
    out = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert "".join(logprobs.tokens) == out.choices[0].text
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 2 and top[token] == logprob == max(top.values())
    assert logprobs.text_offset == sorted(logprobs.text_offset)


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_stream_usage_chunk(
    client: openai.OpenAI, model_id: str, include_usage: bool
) -> None:
    chunks = list(
        client.completions.create(
            model=model_id, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": include_usage}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    with_usage = [c for c in chunks if c.usage is not None]
    if not include_usage:
        assert with_usage == []
        return
    assert with_usage == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5


def test_invalid_argument_from_the_frontend_is_400_with_param(
    client: openai.OpenAI, model_id: str
) -> None:
    for stream in (False, True):  # a stream fails before its first frame: a real status
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=model_id, messages=USER, temperature=-1, stream=stream
            )
        assert info.value.status_code == 400
        assert (info.value.param, info.value.type) == ("temperature", "invalid_request_error")
        assert "temperature" in info.value.message


# ---- openai client, async ------------------------------------------------------------


async def test_async_chat_and_completion(
    async_client: openai.AsyncOpenAI, client: openai.OpenAI, model_id: str
) -> None:
    chat = dict(model=model_id, messages=USER, max_tokens=8, temperature=0)
    text = dict(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0)
    full_chat, full_text = await asyncio.gather(
        async_client.chat.completions.create(**chat), async_client.completions.create(**text)
    )
    streamed = "".join(
        [c.choices[0].delta.content or "" async for c in await async_client.chat.completions.create(
            **chat, stream=True) if c.choices]
    )  # fmt: skip
    assert streamed == full_chat.choices[0].message.content
    assert full_text.choices[0].text == client.completions.create(**text).choices[0].text
    models = await async_client.models.list()
    assert [m.id for m in models.data] == [model_id]


# ---- raw HTTP ------------------------------------------------------------------------


def test_sse_bytes_frames_order_and_headers(root: str, model_id: str) -> None:
    body = {
        "model": model_id, "messages": USER, "n": 2, "max_tokens": 4, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    resp = httpx.post(
        f"{root}/v1/chat/completions", json=body, headers={"X-Request-Id": "live-sse-1"}, timeout=60
    )
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["cache-control"] == "no-cache"
    assert resp.headers["x-accel-buffering"] == "no"
    assert resp.headers["x-request-id"] == "live-sse-1"
    frames = sse_frames(resp.content)
    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    chunks = [json.loads(f) for f in frames[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-live-sse-1"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    first_seen: dict[int, dict[str, Any]] = {}
    finished: list[int] = []
    for chunk in chunks[:-1]:
        assert chunk["usage"] is None
        for choice in chunk["choices"]:
            first_seen.setdefault(choice["index"], choice["delta"])
            assert choice["index"] not in finished, "a frame after the choice's finish"
            if choice["finish_reason"] is not None:
                assert choice["finish_reason"] == "length" and choice["delta"] == {}
                finished.append(choice["index"])
    assert sorted(finished) == [0, 1]
    assert all(delta.get("role") == "assistant" for delta in first_seen.values())
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_generate_native_stream_equals_unary(root: str) -> None:
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    unary = httpx.post(f"{root}/generate", json=body, timeout=60).json()
    resp = httpx.post(f"{root}/generate", json=body | {"stream": True}, timeout=60)
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(resp.content)
    assert frames[-1] == "[DONE]"
    # SGLang's default stream: each frame holds the text and ids so far.
    outputs = [json.loads(f) for f in frames[:-1]]
    assert outputs[-1]["text"] == unary["text"]
    assert outputs[-1]["output_ids"] == unary["output_ids"]
    assert outputs[-1]["meta_info"]["finish_reason"] == unary["meta_info"]["finish_reason"]
    assert unary["meta_info"]["completion_tokens"] == len(unary["output_ids"])


def test_tokenize_detokenize_round_trip(root: str, default_model_dir: Path) -> None:
    text = "Hello, world! 你好 tokenline"
    tokenized = httpx.post(
        f"{root}/v1/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30
    ).json()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    assert tokenized["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert tokenized["count"] == len(tokenized["tokens"])
    model = httpx.get(f"{root}/v1/models", timeout=30).json()["data"][0]
    assert tokenized["max_model_len"] == model["max_model_len"]
    back = httpx.post(f"{root}/v1/detokenize", json={"tokens": tokenized["tokens"]}, timeout=30)
    assert back.json() == {"prompt": text}
    bad = httpx.post(f"{root}/v1/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_stream_disconnect_frees_the_scheduler(stack: LocalStack, root: str, model_id: str) -> None:
    before = finish_counts(stack)
    body = {"model": model_id, "messages": USER, "stream": True} | LONG
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{root}/v1/chat/completions", json=body) as resp,
    ):
        frames = (line for line in resp.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(frames)
        assert scheduler_load(stack)[1] == 1, "the request should be decoding now"
    # Leaving the block closed the connection mid-stream.
    assert wait_for_finishes(stack, before, 1) == {"abort": 1}


def test_a_retry_with_the_id_of_a_request_just_cancelled_gets_its_own_answer(
    stack: LocalStack, root: str, model_id: str
) -> None:
    """The cancelled request's abort row can never reach the retry: each has its own rid."""
    before = finish_counts(stack)
    body = {"model": model_id, "messages": USER, "stream": True, **LONG}
    headers = {"X-Request-Id": "retry-me"}
    url = f"{root}/v1/chat/completions"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url, json=body, headers=headers) as first:
            lines = first.iter_lines()
            while '"content"' not in next(lines):  # decoding now
                pass
        # Closed mid-stream (a cancel); the retry goes out at once, same id.
        retry = http.post(url, json=body | {"stream": False, "max_tokens": 5}, headers=headers)
    assert retry.status_code == 200, retry.text
    assert retry.json()["id"] == "chatcmpl-retry-me"
    assert retry.json()["choices"][0]["finish_reason"] == "length"
    assert retry.json()["usage"]["completion_tokens"] == 5
    assert wait_for_finishes(stack, before, 2) == {"abort": 1, "length": 1}


def test_one_request_id_in_flight_twice_streams_twice_and_echoes_it(
    stack: LocalStack, root: str, model_id: str
) -> None:
    """X-Request-Id is the client's label, not a key: a second request with it is
    served beside the first, and each response names it."""
    before = finish_counts(stack)
    body = {"model": model_id, "stream": True, "messages": USER, **LONG}
    headers = {"X-Request-Id": "same-id-twice"}
    url = f"{root}/v1/chat/completions"
    with httpx.Client(timeout=60) as http:
        with (
            http.stream("POST", url, json=body, headers=headers) as first,
            http.stream("POST", url, json=body, headers=headers) as second,
        ):
            readers = [first.iter_lines(), second.iter_lines()]  # held: dropping one cancels
            for resp, lines in zip((first, second), readers, strict=True):
                assert resp.status_code == 200
                assert resp.headers["x-request-id"] == "same-id-twice"
                chunk = json.loads(next(lines).removeprefix("data: "))
                assert chunk["id"] == "chatcmpl-same-id-twice"
            assert sum(scheduler_load(stack)) == 2, "the scheduler should hold both"
        assert wait_for_finishes(stack, before, 2) == {"abort": 2}


async def test_unary_disconnect_frees_the_scheduler(
    stack: LocalStack, root: str, model_id: str
) -> None:
    before = finish_counts(stack)
    body = {"model": model_id, "prompt": PROMPT} | LONG
    async with httpx.AsyncClient(timeout=60) as http:
        task = asyncio.ensure_future(http.post(f"{root}/v1/completions", json=body))
        await eventually(lambda: scheduler_load(stack)[1] >= 1, 30, "the request running")
        task.cancel()  # the client gives up on a non-streamed request
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await asyncio.to_thread(wait_for_finishes, stack, before, 1) == {"abort": 1}


@pytest.fixture(scope="module")
def strict_live(stack: LocalStack) -> Iterator[str]:
    """A second, in-process gateway on the same real frontend: key, 4 KiB limit, 1 s deadline."""
    config = GatewayConfig(
        frontend_addr=stack.addr("frontend"),
        api_key="live-key",
        max_body_bytes=4096,
        request_timeout_s=1.0,
    )
    server = GatewayServer(config).start()
    yield server.url
    server.stop()


def test_api_key_on_the_real_stack(strict_live: str, model_id: str) -> None:
    keyed = openai.OpenAI(base_url=f"{strict_live}/v1", api_key="live-key", max_retries=0)
    assert [m.id for m in keyed.models.list().data] == [model_id]
    wrong = openai.OpenAI(base_url=f"{strict_live}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    assert httpx.get(f"{strict_live}/health", timeout=10).status_code == 200


def test_body_limit_and_deadline_on_the_real_stack(
    stack: LocalStack, strict_live: str, model_id: str
) -> None:
    auth = {"Authorization": "Bearer live-key"}
    before = finish_counts(stack)
    big = {"model": model_id, "prompt": "x" * 5000}
    resp = httpx.post(f"{strict_live}/v1/completions", json=big, headers=auth, timeout=10)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    slow = {"model": model_id, "prompt": PROMPT} | LONG
    resp = httpx.post(f"{strict_live}/v1/completions", json=slow, headers=auth, timeout=30)
    assert resp.status_code == 504
    assert resp.json()["error"]["type"] == "timeout_error"
    # The expired deadline cancelled the call, and the frontend aborted upstream (where the
    # request got there at all), rather than letting it run to its 4,000 tokens.
    assert set(wait_for_finishes(stack, before, 0)) <= {"abort"}


def test_a_stream_past_its_deadline_is_aborted_upstream(
    stack: LocalStack, strict_live: str, model_id: str
) -> None:
    """A multiplexed stream's deadline is the gateway's own timer: it must end the SSE
    with the timeout and cancel the stream, which aborts the request upstream."""
    auth = {"Authorization": "Bearer live-key"}
    before = finish_counts(stack)
    body = {"model": model_id, "prompt": PROMPT, "stream": True} | LONG
    resp = httpx.post(f"{strict_live}/v1/completions", json=body, headers=auth, timeout=30)
    if resp.status_code == 200:  # the first token came before the deadline (as usual)
        last = resp.text.strip().split("\n\n")[-1].removeprefix("data: ")
        assert json.loads(last)["error"]["type"] == "timeout_error"
        assert wait_for_finishes(stack, before, 1) == {"abort": 1}
    else:
        assert resp.status_code == 504
        assert set(wait_for_finishes(stack, before, 0)) <= {"abort"}


def test_health_and_metrics(root: str) -> None:
    assert httpx.get(f"{root}/health", timeout=10).json() == {"status": "ok"}
    metrics = httpx.get(f"{root}/metrics", timeout=10).text
    assert 'route="/v1/chat/completions"' in metrics and 'status="200"' in metrics


def test_real_responses_match_openapi(root: str, model_id: str) -> None:
    """Every body the real stack sent validates against the gateway's own /openapi.json."""
    spec = httpx.get(f"{root}/openapi.json", timeout=10).json()
    chat = {"model": model_id, "messages": USER, "max_tokens": 3, "logprobs": True}
    chat |= {"top_logprobs": 2}
    text = {"model": model_id, "prompt": PROMPT, "max_tokens": 3, "logprobs": 2}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    native = {"text": [PROMPT, "Hi"], "sampling_params": {"max_new_tokens": 3}}
    native |= {"return_logprob": True}
    one_model = "/v1/models/{model_id}"
    cases: list[tuple[str, str, dict[str, Any] | None, str]] = [
        ("/v1/chat/completions", "", chat, "ChatCompletion"),
        ("/v1/chat/completions", "", chat | usage, "ChatCompletionChunk"),
        ("/v1/chat/completions", "", chat | {"top_p": 0}, "ErrorResponse"),
        ("/v1/completions", "", text, "Completion"),
        ("/v1/completions", "", text | usage, "Completion"),
        ("/generate", "", native, "GenerateResponse"),
        ("/generate", "", native | {"stream": True}, "GenerateOutput"),
        ("/v1/tokenize", "", {"prompt": PROMPT}, "TokenizeResponse"),
        ("/v1/detokenize", "", {"tokens": [1, 2, 3]}, "DetokenizeResponse"),
        ("/v1/models", "", None, "ModelList"),
        (one_model, model_id, None, "Model"),
        (one_model, "no-such-model", None, "ErrorResponse"),
        ("/health", "", None, "HealthResponse"),
    ]
    for template, model, body, schema in cases:
        path = template.replace("{model_id}", model)
        method = "GET" if body is None else "POST"
        resp = httpx.request(method, f"{root}{path}", json=body, timeout=60)
        documented = spec["paths"][template][method.lower()]["responses"]
        assert str(resp.status_code) in documented, (path, resp.text)
        is_sse = resp.headers["content-type"].startswith("text/event-stream")
        frames = sse_frames(resp.content)[:-1] if is_sse else [resp.text]
        check = validator(spec, schema)
        for frame in frames:
            errors = [e.message for e in check.iter_errors(json.loads(frame))]
            assert errors == [], (path, schema, errors)
