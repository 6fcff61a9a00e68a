"""The official openai SDK (sync and async) against the real gateway + a fake frontend."""

from __future__ import annotations

import openai
import pytest
from fake_frontend import CREATED, MODEL_ID, PIECES, FakeFrontendServicer
from tokenline.v1 import openai_pb2

TEXT = "".join(PIECES)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(gateway_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)


def test_chat_non_stream_fields_reach_frontend(
    client: openai.OpenAI, fake: FakeFrontendServicer
) -> None:
    resp = client.chat.completions.create(
        model=MODEL_ID,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        n=2,
        seed=1234,
        stop="\n",
        temperature=0.25,
        max_completion_tokens=17,
        max_tokens=9,
        extra_body={"top_k": 5, "chat_template_kwargs": {"enable_thinking": False}},
    )
    req: openai_pb2.ChatCompletionRequest = fake.observed.last("ChatCompletion")
    assert [m.role for m in req.messages] == ["system", "user"]
    assert req.messages[0].content == "be brief"
    assert req.messages[1].WhichOneof("content_kind") == "parts"
    assert [(p.type, p.text) for p in req.messages[1].parts.parts] == [("text", "hi")]
    assert req.sampling.n == 2 and req.sampling.seed == 1234 and req.sampling.top_k == 5
    assert list(req.sampling.stop) == ["\n"]
    assert req.sampling.temperature == pytest.approx(0.25)
    assert req.max_completion_tokens == 17 and req.sampling.max_tokens == 9
    assert dict(req.chat_template_kwargs) == {"enable_thinking": False}
    assert not req.stream and not req.logprobs and not req.HasField("top_logprobs")
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.message.content == TEXT and c.finish_reason == "stop" for c in resp.choices)
    assert resp.choices[0].logprobs is None
    assert resp.usage is not None and resp.usage.total_tokens == 7
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 1
    assert resp.created == CREATED and resp.object == "chat.completion"


def test_chat_stop_list_and_logprobs(client: openai.OpenAI, fake: FakeFrontendServicer) -> None:
    resp = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, stop=["a", "b"], logprobs=True, top_logprobs=3
    )
    req = fake.observed.last("ChatCompletion")
    assert list(req.sampling.stop) == ["a", "b"]
    assert req.logprobs and req.top_logprobs == 3
    logprobs = resp.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert logprobs.content[0].token == PIECES[0] and logprobs.content[0].logprob == -0.5
    assert logprobs.content[0].bytes == list(PIECES[0].encode())
    assert logprobs.content[0].top_logprobs[0].token == PIECES[0]


def test_chat_stream_with_usage(client: openai.OpenAI, fake: FakeFrontendServicer) -> None:
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=MESSAGES,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    chunks = list(stream)
    req = fake.observed.last("ChatCompletionStream")
    assert req.stream and req.stream_options.include_usage and req.sampling.n == 2
    texts = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == {0: TEXT, 1: TEXT}
    assert finishes == {0: ["stop"], 1: ["stop"]}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[2].choices[0].logprobs is not None
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2


def test_completion_non_stream(client: openai.OpenAI, fake: FakeFrontendServicer) -> None:
    resp = client.completions.create(
        model=MODEL_ID, prompt=["one", "two"], max_tokens=4, stop="x", echo=True, logprobs=2
    )
    req: openai_pb2.CompletionRequest = fake.observed.last("Completion")
    assert list(req.prompts) == ["one", "two"] and not req.prompt_token_ids
    assert req.sampling.max_tokens == 4 and list(req.sampling.stop) == ["x"]
    assert req.echo and req.logprobs == 2
    assert [c.text for c in resp.choices] == [TEXT, TEXT]
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.prompt_tokens == 5


def test_completion_token_id_prompts(client: openai.OpenAI, fake: FakeFrontendServicer) -> None:
    client.completions.create(model=MODEL_ID, prompt=[1, 2, 3])
    assert [list(t.ids) for t in fake.observed.last("Completion").prompt_token_ids] == [[1, 2, 3]]
    client.completions.create(model=MODEL_ID, prompt=[[1, 2], [3]])
    req = fake.observed.last("Completion")
    assert [list(t.ids) for t in req.prompt_token_ids] == [[1, 2], [3]] and not req.prompts


def test_completion_stream(client: openai.OpenAI, fake: FakeFrontendServicer) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_ID, prompt="p", stream=True, stream_options={"include_usage": True}
        )
    )
    assert fake.observed.last("CompletionStream").stream
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, None, "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


async def test_async_chat_stream_and_non_stream(
    async_client: openai.AsyncOpenAI, fake: FakeFrontendServicer
) -> None:
    resp = await async_client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, seed=7)
    assert resp.choices[0].message.content == TEXT
    assert fake.observed.last("ChatCompletion").sampling.seed == 7
    stream = await async_client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == TEXT


async def test_async_completion(async_client: openai.AsyncOpenAI) -> None:
    resp = await async_client.completions.create(model=MODEL_ID, prompt="p")
    assert resp.choices[0].text == TEXT and resp.object == "text_completion"


def test_models(client: openai.OpenAI, fake: FakeFrontendServicer) -> None:
    fake.script.models = (MODEL_ID, "org/other")
    assert [m.id for m in client.models.list()] == [MODEL_ID, "org/other"]
    assert client.models.retrieve("org/other").owned_by == "tokenline"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("missing")
    assert info.value.code == "model_not_found"


def test_mid_stream_failure_raises_api_error(
    client: openai.OpenAI, fake: FakeFrontendServicer
) -> None:
    import grpc

    fake.script.fail_code = grpc.StatusCode.UNAVAILABLE
    fake.script.fail_message = "scheduler went away"
    fake.script.fail_after = 2
    stream = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, stream=True)
    received = []
    with pytest.raises(openai.APIError, match="scheduler went away") as info:
        for chunk in stream:
            received.append(chunk)
    assert len(received) == 2
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "unavailable"
