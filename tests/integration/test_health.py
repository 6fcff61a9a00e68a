"""Crashes, health and reclamation on the module's own live stack (it kills services, so it
shares none). Each service in turn is killed with SIGKILL by PID, as a crash would end it,
while 8 streams are decoding:

* every client's stream ends in an error, not a finish, and /health turns 503;
* once the service is restarted, /health is 200 and a request succeeds;
* then no process holds any state for the killed requests and the KV pool is free.

A killed frontend takes its lease on the scheduler with it, so the scheduler aborts
that frontend's requests (nobody else would abort them): its metrics count them as
aborted, where without the lease they would decode to their 4,000 tokens.

The waits are bounded only so that a failure ends: ``LIMIT_S`` is far above what each
takes (about a second) and far below what a stream left running would take."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from services.launch import LocalStack
from tests.live_stack import finish_counts, module_stack, wait_for_finishes
from tests.waiting import wait_until

NUM_STREAMS = 8
LIMIT_S = 30.0
STREAM = {
    "model": "tokenline-tiny",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "stream": True,
    "max_tokens": 4000,
    "ignore_eos": True,
}

stack = module_stack(  # it kills each service, the detokenizer too
    "health-logs",
    own_detokenizer=True,
    scheduler_args=["--kv-cache-tokens", "16384", "--num-threads", "1"],
)


def health_status(stack: LocalStack) -> int | None:
    """/health's status, or None while nothing answers (the gateway itself is down)."""
    try:
        return httpx.get(f"http://{stack.host}:{stack.ports.gateway}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def deep_health(stack: LocalStack) -> httpx.Response:
    return httpx.get(f"http://{stack.host}:{stack.ports.gateway}/health_generate", timeout=15)


def one_token(stack: LocalStack) -> httpx.Response:
    body = {"model": "tokenline-tiny", "prompt": "ping", "max_tokens": 1}
    return httpx.post(f"{stack.base_url}/completions", json=body, timeout=30)


def scheduler_is_idle(stack: LocalStack) -> bool:
    info = stack.scheduler_info()
    return info.num_waiting + info.num_running == 0


async def decoding_stream(http: httpx.AsyncClient, url: str, started: asyncio.Event) -> str:
    """One stream: returns how it ended ("error" or "finished") once it has; ``started``
    counts down as soon as its first content token arrived."""
    try:
        async with http.stream("POST", url, json=STREAM) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                frame = json.loads(line.removeprefix("data: "))
                if "error" in frame:
                    return "error"
                if frame["choices"] and frame["choices"][0]["delta"].get("content"):
                    started.set()
                if frame["choices"] and frame["choices"][0].get("finish_reason"):
                    return "finished"
            return "error"  # ended without a finish: the client sees a broken stream
    except httpx.TransportError:
        return "error"


async def kill_under_streams(stack: LocalStack, service: str) -> list[str]:
    """Start the streams, kill ``service`` once all decode; how each stream ended."""
    url = f"{stack.base_url}/chat/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        tasks = [asyncio.create_task(decoding_stream(http, url, ev)) for ev in started]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
        stack.kill(service)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), LIMIT_S))


@pytest.mark.parametrize("service", ["detokenizer", "scheduler", "frontend", "gateway"])
def test_kill_9_under_running_streams_errors_recovers_and_leaks_nothing(
    stack: LocalStack, service: str
) -> None:
    assert health_status(stack) == 200
    assert deep_health(stack).status_code == 200
    before = finish_counts(stack)
    assert asyncio.run(kill_under_streams(stack, service)) == ["error"] * NUM_STREAMS
    if service == "gateway":
        assert health_status(stack) is None  # nothing answers at all
    else:
        wait_until(lambda: health_status(stack) == 503, LIMIT_S, "/health 503", 0.05)
        assert one_token(stack).status_code == 503  # and requests agree with it
        failed = deep_health(stack)
        assert failed.status_code == 503
        assert "generation failed" in failed.json()["error"]["message"]
    if service == "frontend":
        # Only the lease can end its requests: the frontend that sent them is gone.
        wait_until(lambda: scheduler_is_idle(stack), LIMIT_S, "scheduler idle", 0.05)
        ended = wait_for_finishes(stack, before, NUM_STREAMS, LIMIT_S)
        assert ended == {"abort": NUM_STREAMS}
    stack.restart(service)
    wait_until(lambda: health_status(stack) == 200, LIMIT_S, "/health 200", 0.05)
    assert deep_health(stack).status_code == 200
    reply = one_token(stack)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 1
    idle = dict.fromkeys(stack.live_state(), 0)
    wait_until(lambda: stack.live_state() == idle, LIMIT_S, "no live state", 0.05)


def test_a_frozen_frontend_loses_its_lease_and_the_scheduler_frees_its_requests(
    stack: LocalStack,
) -> None:
    """A partition, as the scheduler sees it: the frontend's connection stays open but
    nothing answers (SIGSTOP). Keepalive pings go unanswered, the connection is dropped,
    the lease ends and the requests are aborted; after SIGCONT the frontend attaches
    again and serves."""
    wait_until(lambda: health_status(stack) == 200, LIMIT_S, "/health 200", 0.05)
    url = f"{stack.base_url}/chat/completions"
    frontend = stack.procs["frontend"]
    before = finish_counts(stack)

    async def freeze_while_decoding() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            started = asyncio.Event()
            task = asyncio.create_task(decoding_stream(http, url, started))
            await asyncio.wait_for(started.wait(), 60)
            frontend.send_signal(signal.SIGSTOP)
            try:
                await asyncio.to_thread(
                    wait_until, lambda: scheduler_is_idle(stack), LIMIT_S, "scheduler idle", 0.05
                )
            finally:
                frontend.send_signal(signal.SIGCONT)
                assert await asyncio.wait_for(task, LIMIT_S) == "error"

    asyncio.run(freeze_while_decoding())
    assert wait_for_finishes(stack, before, 1, LIMIT_S) == {"abort": 1}  # not its length
    wait_until(lambda: health_status(stack) == 200, LIMIT_S, "/health 200 again", 0.05)
    reply = one_token(stack)
    assert reply.status_code == 200, reply.text
    idle = dict.fromkeys(stack.live_state(), 0)
    wait_until(lambda: stack.live_state() == idle, LIMIT_S, "no live state", 0.05)
