"""Load generation: Poisson arrivals at `request_rate`, at most `max_concurrency` in flight.

Arrival times are drawn up front (seeded), so two servers benchmarked with the
same settings see the same schedule. A request that arrives while the
concurrency limit is reached waits for a slot; its latency counts from when it
is actually sent, as in vLLM's `bench serve`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from bench.serve.client import RequestResult, RequestSettings, new_session, send_request
from bench.serve.datasets import BenchPrompt


@dataclass(frozen=True, slots=True)
class LoadConfig:
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """Results in prompt order, and the wall time from the first send to the last finish."""

    results: list[RequestResult]
    duration_s: float


def arrival_delays(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process), 0 at inf."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)]


async def run_load(
    settings: RequestSettings, prompts: Sequence[BenchPrompt], load: LoadConfig
) -> RunOutcome:
    limit = load.max_concurrency or len(prompts) or 1
    semaphore = asyncio.Semaphore(limit)
    async with new_session(limit, settings.timeout_s) as client:
        run_start = time.perf_counter()

        async def limited(prompt: BenchPrompt) -> RequestResult:
            async with semaphore:
                return await send_request(client, settings, prompt, run_start)

        tasks = []
        for prompt, delay in zip(
            prompts, arrival_delays(len(prompts), load.request_rate, load.seed), strict=True
        ):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - run_start
    return RunOutcome(list(results), duration)


def fill_token_counts(
    outcome: RunOutcome, prompts: Sequence[BenchPrompt], tokenizer: PreTrainedTokenizerBase
) -> None:
    """Token counts for successes whose server sent no usage: the prompt's known length and
    the tokenizer's count of the generated text."""
    for result, prompt in zip(outcome.results, prompts, strict=True):
        if result.success and not result.is_usage_from_server:
            result.prompt_tokens = prompt.prompt_len
            result.output_tokens = len(tokenizer.encode(result.text, add_special_tokens=False))
