"""Health tells the truth: the gateway's /health follows the frontend's readiness, which
is SERVING exactly while a request could complete (detokenizer stream up, a scheduler
answering). Services are killed with SIGKILL by PID, as a crash would end them, on the
module's own stack (``stack``, tests/conftest.py)."""

from __future__ import annotations

import time

import httpx
import pytest

from services.launch import LocalStack


def health_status(stack: LocalStack) -> int:
    return httpx.get(f"http://{stack.host}:{stack.ports.gateway}/health", timeout=5).status_code


def seconds_until(stack: LocalStack, status: int, limit_s: float) -> float:
    """How long /health took to answer ``status``; fails past ``limit_s``."""
    started = time.monotonic()
    while health_status(stack) != status:
        elapsed = time.monotonic() - started
        assert elapsed < limit_s, f"/health not {status} after {elapsed:.1f}s"
        time.sleep(0.05)
    return time.monotonic() - started


def deep_health(stack: LocalStack) -> httpx.Response:
    return httpx.get(f"http://{stack.host}:{stack.ports.gateway}/health_generate", timeout=15)


def one_token(stack: LocalStack) -> httpx.Response:
    body = {"model": "tokenline-tiny", "prompt": "ping", "max_tokens": 1}
    return httpx.post(f"{stack.base_url}/completions", json=body, timeout=30)


@pytest.mark.parametrize("service", ["detokenizer", "scheduler"])
def test_health_goes_503_when_a_service_dies_and_200_when_it_is_back(
    stack: LocalStack, service: str
) -> None:
    assert health_status(stack) == 200
    assert deep_health(stack).status_code == 200
    stack.kill(service)
    assert seconds_until(stack, 503, limit_s=2.0) < 2.0
    assert one_token(stack).status_code == 503  # and requests agree with it
    failed = deep_health(stack)
    assert failed.status_code == 503 and "generation failed" in failed.json()["error"]["message"]
    stack.restart(service)
    seconds_until(stack, 200, limit_s=20.0)
    assert deep_health(stack).status_code == 200
    reply = one_token(stack)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 1
