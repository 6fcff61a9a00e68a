"""DynamicBatchTokenizer with the real DeepSeek tokenizer of the default model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
from transformers import PreTrainedTokenizerBase

from services.frontend.dispatch.batch_tokenizer import DynamicBatchTokenizer


def prompts(count: int) -> list[str]:
    """Distinct texts of different lengths, with CJK, emoji and a control token."""
    pieces = ["hello", "世界", "🙂 ok", "<｜User｜>", "  spaced  out", "numbers 12345"]
    return [f"{i}: " + " ".join(pieces[: 1 + i % len(pieces)]) * (1 + i % 7) for i in range(count)]


def recorder(sizes: list[int]) -> Callable[[int, float], None]:
    """An on_batch hook keeping each call's size; a call always takes some time."""

    def record(size: int, seconds: float) -> None:
        assert seconds > 0
        sizes.append(size)

    return record


async def test_64_concurrent_encodes_share_few_calls_and_each_gets_its_own_ids(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    batcher = DynamicBatchTokenizer(tokenizer, window_s=0.002, max_batch_size=64)
    texts = prompts(64)
    try:
        results = await asyncio.gather(*(batcher.encode(t, False) for t in texts))
    finally:
        await batcher.close()
    assert results == [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert batcher.num_requests == 64
    assert batcher.num_calls <= 4


async def test_mixed_special_token_flags_go_to_separate_calls(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    batcher = DynamicBatchTokenizer(tokenizer)
    texts = prompts(16)
    flags = [i % 2 == 0 for i in range(16)]
    try:
        results = await asyncio.gather(
            *(batcher.encode(t, f) for t, f in zip(texts, flags, strict=True))
        )
    finally:
        await batcher.close()
    expected = [
        tokenizer.encode(t, add_special_tokens=f) for t, f in zip(texts, flags, strict=True)
    ]
    assert results == expected
    assert batcher.num_calls == 2


async def test_batches_never_exceed_max_batch_size(tokenizer: PreTrainedTokenizerBase) -> None:
    sizes: list[int] = []
    batcher = DynamicBatchTokenizer(tokenizer, max_batch_size=8, on_batch=recorder(sizes))
    texts = prompts(64)
    try:
        results = await asyncio.gather(*(batcher.encode(t) for t in texts))
    finally:
        await batcher.close()
    assert results == [tokenizer.encode(t) for t in texts]
    assert max(sizes) <= 8 and sum(sizes) == 64 and len(sizes) == batcher.num_calls


async def test_a_lone_request_does_not_wait_for_the_window(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    batcher = DynamicBatchTokenizer(tokenizer, window_s=60.0)
    try:
        ids = await asyncio.wait_for(batcher.encode("just me"), timeout=20)
    finally:
        await batcher.close()
    assert ids == tokenizer.encode("just me")


async def test_requests_arriving_while_the_tokenizer_is_busy_form_one_batch(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    sizes: list[int] = []
    batcher = DynamicBatchTokenizer(tokenizer, window_s=0.002, on_batch=recorder(sizes))
    release = threading.Event()
    busy = asyncio.create_task(batcher.run(lambda: release.wait(30)))
    texts = prompts(10)
    try:
        tasks = []
        for text in texts:  # staggered arrivals, all while the worker is busy
            tasks.append(asyncio.create_task(batcher.encode(text)))
            await asyncio.sleep(0.005)
        release.set()
        results = await asyncio.gather(*tasks)
        await busy
    finally:
        release.set()
        await batcher.close()
    assert results == [tokenizer.encode(t) for t in texts]
    # The first one found the tokenizer idle; everyone after it waited together.
    assert sizes == [1, 9]


async def test_a_burst_that_trickles_in_is_gathered_for_the_window(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    sizes: list[int] = []
    # The window is the point, so it is generous: five arrivals 10 ms apart fit in it even
    # on a machine stalled for seconds (the test waits the window out once).
    batcher = DynamicBatchTokenizer(tokenizer, window_s=3.0, on_batch=recorder(sizes))
    texts = prompts(6)
    try:
        tasks = []
        for text in texts:  # 10 ms apart: each alone in the queue when it arrives
            tasks.append(asyncio.create_task(batcher.encode(text)))
            await asyncio.sleep(0.01)
        results = await asyncio.gather(*tasks)
    finally:
        await batcher.close()
    assert results == [tokenizer.encode(t) for t in texts]
    # The first found the server quiet; the rest came within a window of it.
    assert sizes == [1, 5]


async def test_a_cancelled_caller_does_not_disturb_the_others(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    batcher = DynamicBatchTokenizer(tokenizer)
    release = threading.Event()
    busy = asyncio.create_task(batcher.run(lambda: release.wait(30)))
    texts = prompts(5)
    try:
        tasks = [asyncio.create_task(batcher.encode(t)) for t in texts]
        # Not a timed wait: a zero sleep yields one loop pass, in which every new task
        # runs up to its await, so all five texts are queued when the third is cancelled.
        await asyncio.sleep(0)
        tasks[2].cancel()
        release.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        await busy
    finally:
        release.set()
        await batcher.close()
    assert isinstance(done[2], asyncio.CancelledError)
    assert [d for i, d in enumerate(done) if i != 2] == [
        tokenizer.encode(t) for i, t in enumerate(texts) if i != 2
    ]


async def test_one_bad_text_fails_only_its_own_caller(tokenizer: PreTrainedTokenizerBase) -> None:
    batcher = DynamicBatchTokenizer(tokenizer)
    inputs: list = ["fine", 12345, "also fine"]  # an int is not text: the tokenizer refuses it
    try:
        done = await asyncio.gather(*(batcher.encode(t) for t in inputs), return_exceptions=True)
    finally:
        await batcher.close()
    assert done[0] == tokenizer.encode("fine") and done[2] == tokenizer.encode("also fine")
    assert isinstance(done[1], Exception)


async def test_run_counts_one_call_per_job(tokenizer: PreTrainedTokenizerBase) -> None:
    batcher = DynamicBatchTokenizer(tokenizer)
    try:
        ids = await batcher.run(lambda: tokenizer.encode("job"))
    finally:
        await batcher.close()
    assert ids == tokenizer.encode("job")
    assert (batcher.num_calls, batcher.num_requests) == (1, 1)


@pytest.mark.parametrize("kwargs", [{"window_s": -1.0}, {"max_batch_size": 0}])
def test_bad_settings_are_refused(tokenizer: PreTrainedTokenizerBase, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DynamicBatchTokenizer(tokenizer, **kwargs)
