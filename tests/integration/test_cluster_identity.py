"""Two frontends (each behind its own gateway), two schedulers, one detokenizer: the
deploy files' shape. Rids are made by the frontends and unique across the cluster, so
clients that pick the same id through different frontends each get their own text."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.launch import LocalStack, StackPorts
from tests.live_stack import dump_logs

pytestmark = pytest.mark.live

NUM_PAIRS = 24
NEAR_TIE = 1e-3  # logprob gap under which two float32 runs of a prompt may pick differently


@pytest.fixture(scope="module")
def cluster(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LocalStack]]:
    """Stack a runs all four; stack b adds a scheduler, a frontend and a gateway that
    share a's detokenizer. Both frontends route to both schedulers."""
    ports_a = StackPorts.free()
    ports_b = dataclasses.replace(StackPorts.free(), detokenizer=ports_a.detokenizer)
    schedulers = f"127.0.0.1:{ports_a.scheduler},127.0.0.1:{ports_b.scheduler}"
    args: dict[str, Any] = {
        # Batch-invariant float32: a prompt's greedy tokens do not depend on its batch, so
        # the reference answers can be computed all at once too.
        "scheduler_args": ["--dtype", "float32", "--num-threads", "1", "--batch-invariant"],
        "frontend_args": ["--scheduler-addrs", schedulers],
    }
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    stacks = [
        LocalStack(str(default_model_dir), ports, log_dir=log_dir / name, **args)
        for name, ports in (("a", ports_a), ("b", ports_b))
    ]
    try:
        # Side by side: a start is mostly imports and model loading, which the two overlap;
        # b's services wait for a's detokenizer and scheduler as they would in a cluster.
        with ThreadPoolExecutor(2) as pool:
            started = [
                pool.submit(stacks[0].start),
                pool.submit(stacks[1].start, only=("scheduler", "frontend", "gateway")),
            ]
            for future in started:
                future.result()
        deadline = time.monotonic() + 30
        while any(s.scheduler_info().num_frontends < 2 for s in stacks):
            assert time.monotonic() < deadline, "frontends did not attach to both schedulers"
            time.sleep(0.1)
        yield stacks
    except BaseException:
        dump_logs(log_dir / "a")
        dump_logs(log_dir / "b")
        raise
    finally:
        # Callers before callees across both stacks: a scheduler drains while any
        # frontend's lease is open, and the shared detokenizer while any scheduler pushes.
        for layer in (("gateway", "frontend"), ("scheduler",), ("detokenizer",)):
            for stack in stacks:
                stack.stop(only=layer)


def live_state(stacks: list[LocalStack]) -> list[int]:
    """Requests held, per process, and KV tokens held by requests: all zero when idle."""
    held = []
    for stack in stacks:
        state = stack.live_state()  # the shared detokenizer counted once, below
        held += [state["frontend_requests"], state["scheduler_requests"], state["kv_tokens_held"]]
    detok = stacks[0].detokenizer_info()
    return [*held, detok.num_live_states, detok.num_duplicate_rids]


async def chat(
    http: httpx.AsyncClient, stack: LocalStack, prompt: str, request_id: str = ""
) -> dict[str, Any]:
    body = {
        "model": "tokenline-tiny",
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
        "max_tokens": 6,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    headers = {"X-Request-Id": request_id} if request_id else {}
    resp = await http.post(f"{stack.base_url}/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_same_greedy_run(got: dict[str, Any], solo: dict[str, Any]) -> None:
    """The same tokens as the reference run, or the same up to a near-tie in the
    reference's own logprobs (after which greedy runs may part: the two schedulers
    are separate processes, each invariant only to its own batches)."""
    got_tokens = [t["token"] for t in got["choices"][0]["logprobs"]["content"]]
    solo_steps = solo["choices"][0]["logprobs"]["content"]
    for i, (token, step) in enumerate(zip(got_tokens, solo_steps, strict=True)):
        if token != step["token"]:
            top = [t["logprob"] for t in step["top_logprobs"]]
            assert top[0] - top[1] < NEAR_TIE, f"token {i}: {token!r} != {step['token']!r}"
            return
    assert got["choices"][0]["message"] == solo["choices"][0]["message"]


async def run_pairs(stacks: list[LocalStack]) -> None:
    prompts = [
        [f"Pair {i}, client {side}: say something." for side in "ab"] for i in range(NUM_PAIRS)
    ]
    async with httpx.AsyncClient(timeout=120) as http:
        # The reference: every prompt through stack a's frontend alone, without ids.
        flat = await asyncio.gather(*(chat(http, stacks[0], p) for pair in prompts for p in pair))
        solo = [flat[2 * i : 2 * i + 2] for i in range(NUM_PAIRS)]
        together = await asyncio.wait_for(
            asyncio.gather(
                *(
                    chat(http, stack, prompt, request_id=f"pair-{i}")
                    for i, pair in enumerate(prompts)
                    for stack, prompt in zip(stacks, pair, strict=True)
                )
            ),
            timeout=120,  # none hangs
        )
    for i in range(NUM_PAIRS):
        for side in range(2):
            got = together[2 * i + side]
            assert got["id"] == f"chatcmpl-pair-{i}"  # the client's id, echoed
            assert_same_greedy_run(got, solo[i][side])


def test_same_request_id_through_two_frontends_each_gets_its_own_text(
    cluster: list[LocalStack],
) -> None:
    before = [s.scheduler_info().num_running for s in cluster]
    assert before == [0, 0]
    asyncio.run(run_pairs(cluster))
    deadline = time.monotonic() + 5
    while (held := live_state(cluster)) != [0] * len(held):
        assert time.monotonic() < deadline, f"state left live: {held}"
        time.sleep(0.05)
