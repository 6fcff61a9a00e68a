"""Per-key limits: a slot per request in flight, a token budget per sliding minute, and
the wait each refusal names."""

from __future__ import annotations

import pytest

from services.common.auth.api_keys import ApiKey
from services.common.errors import RateLimitedError
from services.frontend.dispatch.key_limits import CONCURRENCY_RETRY_S, WINDOW_S, KeyLimiter

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key(name: str = "k", **limits: int) -> ApiKey:
    return ApiKey(name=name, role="user", secret=b"secret-of-" + name.encode(), **limits)


def test_concurrency_refuses_past_the_limit_until_a_release() -> None:
    limiter, key = KeyLimiter(), _key(max_concurrent=2)
    limiter.admit(key)
    limiter.admit(key)
    with pytest.raises(RateLimitedError) as info:
        limiter.admit(key)
    assert info.value.retry_after_s == CONCURRENCY_RETRY_S
    limiter.admit(_key("other", max_concurrent=1))  # each key counts its own
    limiter.release(key)
    limiter.admit(key)


def test_tokens_per_minute_waits_for_the_oldest_charge_to_age_out() -> None:
    clock = Clock()
    limiter, key = KeyLimiter(clock), _key(tokens_per_minute=100)
    limiter.admit(key)
    limiter.charge(key, 60)
    clock.now += 10
    limiter.charge(key, 50)  # 110 spent: over
    clock.now += 5
    with pytest.raises(RateLimitedError) as info:
        limiter.admit(key)
    # Under budget once the first 60 age out: 60 s after they were charged.
    assert info.value.retry_after_s == pytest.approx(WINDOW_S - 15)
    assert "100 tokens per minute" in info.value.message
    clock.now += WINDOW_S - 15
    limiter.admit(key)


def test_no_key_or_no_limits_is_never_refused() -> None:
    limiter = KeyLimiter()
    for _ in range(100):
        limiter.admit(None)
        limiter.admit(_key())
    limiter.charge(_key(), 10**9)
    limiter.admit(_key())
