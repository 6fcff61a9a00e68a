"""Crashes, health and reclamation on the module's own live stack (``stack``,
tests/conftest.py). Each service in turn is killed with SIGKILL by PID, as a crash
would end it, while 8 streams are decoding:

* every client hears an error within 2 s, and /health says 503 within 2 s;
* once the service is restarted, /health is 200 and a request succeeds within 20 s;
* then no process holds any state for the killed requests and the KV pool is free.

A killed frontend takes its lease on the scheduler with it, so the scheduler aborts
that frontend's requests and is idle within 5 s (nobody else would abort them)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from services.launch import LocalStack

NUM_STREAMS = 8
STREAM = {
    "model": "tokenline-tiny",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "stream": True,
    "max_tokens": 4000,
    "ignore_eos": True,
}


def health_status(stack: LocalStack) -> int | None:
    """/health's status, or None while nothing answers (the gateway itself is down)."""
    try:
        return httpx.get(f"http://{stack.host}:{stack.ports.gateway}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def seconds_until(check, limit_s: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        elapsed = time.monotonic() - started
        assert elapsed < limit_s, f"{what} not reached after {elapsed:.1f}s"
        time.sleep(0.05)
    return time.monotonic() - started


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


async def kill_under_streams(stack: LocalStack, service: str) -> float:
    """Start the streams, kill ``service`` once all decode; seconds until all erred."""
    url = f"{stack.base_url}/chat/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        tasks = [asyncio.create_task(decoding_stream(http, url, ev)) for ev in started]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
        killed_at = time.monotonic()
        stack.kill(service)
        endings = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        elapsed = time.monotonic() - killed_at
    assert endings == ["error"] * NUM_STREAMS
    return elapsed


@pytest.mark.parametrize("service", ["detokenizer", "scheduler", "frontend", "gateway"])
def test_kill_9_under_running_streams_errors_fast_recovers_and_leaks_nothing(
    stack: LocalStack, service: str
) -> None:
    assert health_status(stack) == 200
    assert deep_health(stack).status_code == 200
    assert asyncio.run(kill_under_streams(stack, service)) < 2.0
    if service == "gateway":
        assert health_status(stack) is None  # nothing answers at all
    else:
        seconds_until(lambda: health_status(stack) == 503, 2.0, "/health 503")
        assert one_token(stack).status_code == 503  # and requests agree with it
        failed = deep_health(stack)
        assert failed.status_code == 503
        assert "generation failed" in failed.json()["error"]["message"]
    if service == "frontend":
        # Only the lease can end its requests: the frontend that sent them is gone.
        seconds_until(lambda: scheduler_is_idle(stack), 5.0, "scheduler idle")
    restarted_at = time.monotonic()
    stack.restart(service)
    seconds_until(lambda: health_status(stack) == 200, 20.0, "/health 200")
    assert deep_health(stack).status_code == 200
    reply = one_token(stack)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 1
    assert time.monotonic() - restarted_at < 20.0
    idle = dict.fromkeys(stack.live_state(), 0)
    seconds_until(lambda: stack.live_state() == idle, 5.0, f"no live state: {stack.live_state()}")


def test_a_frozen_frontend_loses_its_lease_and_the_scheduler_frees_its_requests(
    stack: LocalStack,
) -> None:
    """A partition, as the scheduler sees it: the frontend's connection stays open but
    nothing answers (SIGSTOP). Keepalive pings go unanswered, the connection is dropped,
    the lease ends and the requests are aborted; after SIGCONT the frontend attaches
    again and serves."""
    seconds_until(lambda: health_status(stack) == 200, 20.0, "/health 200")
    url = f"{stack.base_url}/chat/completions"
    frontend = stack.procs["frontend"]

    async def freeze_while_decoding() -> float:
        async with httpx.AsyncClient(timeout=60) as http:
            started = asyncio.Event()
            task = asyncio.create_task(decoding_stream(http, url, started))
            await asyncio.wait_for(started.wait(), 60)
            frontend.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                await asyncio.to_thread(
                    seconds_until, lambda: scheduler_is_idle(stack), 5.0, "scheduler idle"
                )
                return time.monotonic() - frozen_at
            finally:
                frontend.send_signal(signal.SIGCONT)
                assert await asyncio.wait_for(task, 30) == "error"

    assert asyncio.run(freeze_while_decoding()) < 5.0
    seconds_until(lambda: health_status(stack) == 200, 20.0, "/health 200 again")
    reply = one_token(stack)
    assert reply.status_code == 200, reply.text
    idle = dict.fromkeys(stack.live_state(), 0)
    seconds_until(lambda: stack.live_state() == idle, 5.0, f"no live state: {stack.live_state()}")
