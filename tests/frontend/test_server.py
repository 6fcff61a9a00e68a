"""The real frontend in a real LocalStack, driven through grpc.aio.

The scheduler runs one request at a time (--max-running-requests 1) so a second
request provably waits in its queue. Every ending is checked from the outside
through the three GetInfo RPCs: no live state anywhere and the KV pool full.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from tokenline.v1 import (
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    generate_pb2,
    openai_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from transformers import PreTrainedTokenizerBase

from services.launch import LocalStack
from tests.frontend.validation.test_params import INVALID_OPENAI
from tests.live_stack import running_stack
from tests.waiting import eventually

pytestmark = pytest.mark.live

LONG = 3000  # tokens: far more than a test waits for


@pytest.fixture(scope="module")
def stack(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    with running_stack(
        default_model_dir,
        tmp_path_factory.mktemp("frontend-stack-logs"),
        scheduler_args=[
            "--kv-cache-tokens",
            "8192",
            "--num-threads",
            "1",
            "--max-running-requests",
            "1",
        ],  # fmt: skip
        # A wide window: however slowly a loaded machine lets 64 RPCs in, they batch.
        frontend_args=["--tokenizer-batch-window-ms", "50"],
    ) as stack:
        yield stack


@dataclass
class Clients:
    frontend: frontend_pb2_grpc.FrontendServiceStub
    scheduler: scheduler_pb2_grpc.SchedulerServiceStub
    detokenizer: detokenizer_pb2_grpc.DetokenizerServiceStub

    async def frontend_info(self) -> frontend_pb2.FrontendInfo:
        return await self.frontend.GetInfo(frontend_pb2.FrontendInfoRequest())

    async def scheduler_info(self) -> scheduler_pb2.SchedulerInfo:
        return await self.scheduler.GetInfo(scheduler_pb2.ServerInfoRequest())

    async def wait_until(self, check, timeout: float = 30.0) -> None:
        await eventually(check, timeout, "settled state", poll=0.05)

    async def is_idle(self) -> bool:
        fe = await self.frontend_info()
        sched = await self.scheduler_info()
        detok = await self.detokenizer.GetInfo(detokenizer_pb2.DetokenizerInfoRequest())
        kv_full = sched.num_free_kv_tokens + sched.num_cached_kv_tokens == sched.num_total_kv_tokens
        return (
            fe.num_live_requests == 0
            and sched.num_waiting == 0
            and sched.num_running == 0
            and detok.num_live_states == 0
            and kv_full
        )


@pytest.fixture
async def clients(stack: LocalStack) -> AsyncIterator[Clients]:
    channels = [
        grpc.aio.insecure_channel(stack.addr(n)) for n in ("frontend", "scheduler", "detokenizer")
    ]
    yield Clients(
        frontend_pb2_grpc.FrontendServiceStub(channels[0]),
        scheduler_pb2_grpc.SchedulerServiceStub(channels[1]),
        detokenizer_pb2_grpc.DetokenizerServiceStub(channels[2]),
    )
    for channel in channels:
        await channel.close()


def chat(content: str = "Tell me a long story.", **fields: Any) -> openai_pb2.ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": content}], **fields}
    return json_format.ParseDict(body, openai_pb2.ChatCompletionRequest())


def long_chat(**fields: Any) -> openai_pb2.ChatCompletionRequest:
    return chat(sampling={"max_tokens": LONG, "ignore_eos": True, "temperature": 0}, **fields)


async def wait_running(clients: Clients, num_running: int = 1, num_waiting: int = 0) -> None:
    """Until the scheduler holds exactly this: the requests are decoding (a random
    model may decode special tokens only, so the stream itself can stay silent)."""

    async def check() -> bool:
        info = await clients.scheduler_info()
        return (info.num_running, info.num_waiting) == (num_running, num_waiting)

    await clients.wait_until(check)


async def abort_count(clients: Clients) -> int:
    return (await clients.frontend_info()).num_aborts_sent


# ---- abort at three moments ------------------------------------------------------


async def test_abort_while_waiting_in_the_scheduler_queue(clients: Clients) -> None:
    await clients.wait_until(clients.is_idle)
    before = await abort_count(clients)
    running = clients.frontend.ChatCompletionStream(long_chat())
    await wait_running(clients)
    queued = clients.frontend.ChatCompletionStream(long_chat())
    await wait_running(clients, num_running=1, num_waiting=1)
    queued.cancel()

    async def only_the_running_one_is_left() -> bool:
        info, fe = await clients.scheduler_info(), await clients.frontend_info()
        return info.num_waiting == 0 and info.num_running == 1 and fe.num_live_requests == 1

    await clients.wait_until(only_the_running_one_is_left)
    assert await abort_count(clients) == before + 1
    running.cancel()
    await clients.wait_until(clients.is_idle)
    assert await abort_count(clients) == before + 2


async def test_abort_while_decoding(clients: Clients) -> None:
    await clients.wait_until(clients.is_idle)
    before = await abort_count(clients)
    call = clients.frontend.GenerateStream(
        generate_pb2.GenerateReqInput(
            text=["Once upon a time"],
            sampling_params={"max_new_tokens": LONG, "ignore_eos": True},
        )
    )
    async for response in call:
        if response.outputs[0].output_ids:
            break
    assert (await clients.scheduler_info()).num_running == 1
    call.cancel()
    await clients.wait_until(clients.is_idle)
    assert await abort_count(clients) == before + 1


async def test_abort_of_a_unary_call_while_decoding(clients: Clients) -> None:
    await clients.wait_until(clients.is_idle)
    before = await abort_count(clients)
    call = clients.frontend.ChatCompletion(long_chat())
    await wait_running(clients)
    call.cancel()
    await clients.wait_until(clients.is_idle)
    assert await abort_count(clients) == before + 1


async def test_abort_just_after_the_final_output(clients: Clients) -> None:
    await clients.wait_until(clients.is_idle)
    before = await abort_count(clients)
    request = chat(
        sampling={"max_tokens": 4, "ignore_eos": True}, stream_options={"include_usage": True}
    )
    call = clients.frontend.ChatCompletionStream(request)
    async for chunk in call:
        if chunk.choices and chunk.choices[0].HasField("finish_reason"):
            break
    call.cancel()  # the usage chunk is still to come
    await clients.wait_until(clients.is_idle)
    assert await abort_count(clients) == before  # finished requests are never aborted


# ---- validation -----------------------------------------------------------------


async def test_every_invalid_sampling_field_is_named_and_the_server_keeps_serving(
    clients: Clients,
) -> None:
    cases: list[tuple[str, openai_pb2.ChatCompletionRequest]] = [
        (field, chat(sampling={field: value})) for field, value in INVALID_OPENAI
    ]
    cases += [
        ("max_completion_tokens", chat(max_completion_tokens=0)),
        ("top_logprobs", chat(logprobs=True, top_logprobs=21)),
        ("top_logprobs", chat(top_logprobs=2)),
        ("max_tokens", chat(sampling={"max_tokens": 5000})),
        ("messages", chat(sampling={"max_tokens": 4}, messages=[])),
    ]
    for field, request in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await clients.frontend.ChatCompletion(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert err.value.details().startswith(f"{field}: "), (field, err.value.details())
        assert "Traceback" not in err.value.details()
    assert (await clients.frontend_info()).num_live_requests == 0
    ok = await clients.frontend.ChatCompletion(chat(sampling={"max_tokens": 3}))
    assert ok.usage.completion_tokens >= 1


async def test_refused_suffix_and_then_a_normal_request(clients: Clients) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await clients.frontend.Completion(openai_pb2.CompletionRequest(prompts=["x"], suffix="y"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("suffix: ")
    ok = await clients.frontend.ChatCompletion(chat(sampling={"max_tokens": 3}))
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert (await clients.frontend_info()).num_live_requests == 0


async def test_a_client_id_in_flight_twice_is_two_requests_each_echoing_it(
    clients: Clients,
) -> None:
    """The client's id is a label, not a key: both requests run, each gets its own text
    (equal to a solo greedy run of its prompt) and its response id echoes the label."""
    await clients.wait_until(clients.is_idle)
    greedy = {"temperature": 0.0, "max_tokens": 6}
    prompts = ["Say one thing.", "Say something else entirely."]
    solo = [
        (await clients.frontend.ChatCompletion(chat(p, sampling=greedy))).choices[0].message
        for p in prompts
    ]
    both = await asyncio.gather(
        *(
            clients.frontend.ChatCompletion(chat(p, sampling=greedy, request_id="same"))
            for p in prompts
        )
    )
    assert [r.choices[0].message.content for r in both] == [m.content for m in solo]
    assert [r.id for r in both] == ["chatcmpl-same", "chatcmpl-same"]
    await clients.wait_until(clients.is_idle)


# ---- dynamic batch tokenization ------------------------------------------------------


def distinct_prompts(count: int) -> list[str]:
    return [f"Prompt {i}: " + "lorem ipsum 世界 " * (1 + i % 9) for i in range(count)]


async def test_64_concurrent_tokenize_calls_are_batched_and_get_their_own_ids(
    clients: Clients, tokenizer: PreTrainedTokenizerBase
) -> None:
    before = await clients.frontend_info()
    texts = distinct_prompts(64)
    replies = await asyncio.gather(
        *(
            clients.frontend.Tokenize(
                frontend_pb2.TokenizeRequest(prompt=t, add_special_tokens=True)
            )
            for t in texts
        )
    )
    after = await clients.frontend_info()
    assert [list(r.tokens) for r in replies] == [tokenizer.encode(t) for t in texts]
    assert after.num_tokenized_requests - before.num_tokenized_requests == 64
    assert after.num_tokenizer_calls - before.num_tokenizer_calls <= 16


async def test_64_concurrent_completions_are_batched_and_count_their_own_prompts(
    clients: Clients, tokenizer: PreTrainedTokenizerBase
) -> None:
    await clients.wait_until(clients.is_idle)
    before = await clients.frontend_info()
    texts = distinct_prompts(64)
    replies = await asyncio.gather(
        *(
            clients.frontend.Completion(
                openai_pb2.CompletionRequest(prompts=[t], sampling={"max_tokens": 1})
            )
            for t in texts
        )
    )
    after = await clients.frontend_info()
    assert [r.usage.prompt_tokens for r in replies] == [len(tokenizer.encode(t)) for t in texts]
    assert after.num_tokenized_requests - before.num_tokenized_requests == 64
    assert after.num_tokenizer_calls - before.num_tokenizer_calls <= 16


# ---- input forms, order and metadata -----------------------------------------------


async def test_batch_generate_returns_results_in_input_order(
    clients: Clients, tokenizer: PreTrainedTokenizerBase
) -> None:
    texts = ["The sky is", "Numbers: 1, 2,", "你好", "def main():"]
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    singles = [
        (await clients.frontend.Generate(
            generate_pb2.GenerateReqInput(text=[t], sampling_params=params)
        )).outputs[0]
        for t in texts
    ]  # fmt: skip
    by_text = await clients.frontend.Generate(
        generate_pb2.GenerateReqInput(rid="batch", text=texts, sampling_params=params)
    )
    by_ids = await clients.frontend.Generate(
        generate_pb2.GenerateReqInput(
            input_ids=[{"ids": tokenizer.encode(t)} for t in texts], sampling_params=params
        )
    )
    assert [o.rid for o in by_text.outputs] == [f"batch-{j}" for j in range(4)]
    for response in (by_text, by_ids):
        assert [o.index for o in response.outputs] == [0, 1, 2, 3]
        assert [list(o.output_ids) for o in response.outputs] == [
            list(s.output_ids) for s in singles
        ]
        assert [o.meta_info.prompt_tokens for o in response.outputs] == [
            len(tokenizer.encode(t)) for t in texts
        ]


async def test_final_response_carries_every_stage_time_in_order(clients: Clients) -> None:
    reply = await clients.frontend.ChatCompletion(chat(sampling={"max_tokens": 3}))
    t = reply.times
    stamps = [
        t.received,
        t.templated,
        t.tokenized,
        t.dispatched,
        t.scheduled,
        t.first_token,
        t.finished,
    ]
    assert all(s > 0 for s in stamps), stamps
    assert stamps == sorted(stamps)


async def test_n_choices_with_logprobs_and_usage(clients: Clients) -> None:
    request = chat(
        sampling={"max_tokens": 5, "ignore_eos": True, "n": 2, "seed": 7},
        logprobs=True,
        top_logprobs=3,
    )
    reply = await clients.frontend.ChatCompletion(request)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert len(choice.logprobs.content) == 5
        assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
    assert reply.usage.completion_tokens == 10


async def test_continuous_usage_counts_up_on_every_chunk(clients: Clients) -> None:
    request = chat(
        sampling={"max_tokens": 6, "ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = [c async for c in clients.frontend.ChatCompletionStream(request)]
    counts = [c.usage.completion_tokens for c in chunks[1:-1]]
    assert all(c.HasField("usage") for c in chunks[1:]) and counts == sorted(counts)
    assert counts[-1] == 6 and chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


async def test_streamed_completion_usage_counts_every_choice_and_each_prompt_once(
    clients: Clients, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = ["Count with me", "And me"]
    request = openai_pb2.CompletionRequest(
        prompts=prompts,
        sampling={"max_tokens": 3, "ignore_eos": True, "n": 2},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = [c async for c in clients.frontend.CompletionStream(request)]
    running = [c.usage.completion_tokens for c in chunks[:-1]]
    assert running == sorted(running) and running[-1] == 12  # 2 prompts x 2 choices x 3
    final = chunks[-1]
    assert not final.choices and final.usage.completion_tokens == 12
    assert final.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert final.usage.total_tokens == final.usage.prompt_tokens + 12


async def test_completion_echo_puts_the_prompt_first(clients: Clients) -> None:
    reply = await clients.frontend.Completion(
        openai_pb2.CompletionRequest(prompts=["Echo me"], echo=True, sampling={"max_tokens": 3})
    )
    assert reply.choices[0].text.startswith("Echo me")
    assert reply.times.finished > reply.times.received > 0
