"""Two scheduler replicas behind one frontend: load spreads, a dead one fails fast."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tokenline.v1 import (
    common_pb2,
    frontend_pb2_grpc,
    generate_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

from services.launch import LocalStack, StackPorts, free_port
from tests.live_stack import dump_logs

pytestmark = pytest.mark.live


@pytest.fixture
def two_schedulers(
    default_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[LocalStack, str, subprocess.Popen[bytes]]]:
    ports = StackPorts.free()
    second = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "scheduler-b.log", "wb")  # noqa: SIM115 - closed with the process
    proc_b = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.scheduler",
            "--model",
            str(default_model_dir),
            "--port",
            second.split(":")[1],
            "--detokenizer-addr",
            f"127.0.0.1:{ports.detokenizer}",
            "--num-threads",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    stack = LocalStack(
        str(default_model_dir),
        ports,
        scheduler_args=["--num-threads", "1"],
        frontend_args=["--scheduler-addrs", f"127.0.0.1:{ports.scheduler},{second}"],
        log_dir=tmp_path,
    )
    try:
        stack.start()
        yield stack, second, proc_b
    finally:
        # LocalStack.stop knows only its own four services: replica B is stopped here, by
        # its PID, at the same time (it leaked, still serving, after every run before).
        if proc_b.poll() is None:
            proc_b.send_signal(signal.SIGTERM)
        stack.stop()
        try:
            proc_b.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc_b.kill()
            proc_b.wait()
        log.close()
        dump_logs(tmp_path)


def request(rid: str, tokens: int) -> generate_pb2.GenerateReqInput:
    return generate_pb2.GenerateReqInput(
        rid=rid,
        text=["Hello there"],
        sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=tokens, ignore_eos=True
        ),
    )


async def info(addr: str) -> scheduler_pb2.SchedulerInfo:
    async with grpc.aio.insecure_channel(addr) as ch:
        return await scheduler_pb2_grpc.SchedulerServiceStub(ch).GetInfo(
            scheduler_pb2.ServerInfoRequest(), timeout=5
        )


async def running(addr: str) -> int:
    found = await info(addr)
    return found.num_running + found.num_waiting


async def cached(addr: str) -> int:
    """KV tokens in the replica's prefix cache: nonzero once it has served a request."""
    return (await info(addr)).num_cached_kv_tokens


async def spread_then_kill(
    stack: LocalStack, second: str, replica_b: subprocess.Popen[bytes]
) -> None:
    first = stack.addr("scheduler")
    async with grpc.aio.insecure_channel(stack.addr("frontend")) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        deadline = time.monotonic() + 60  # replica B loads its model in its own time
        while True:  # until the frontend holds a lease on both replicas
            try:
                if (await info(second)).num_frontends == 1 and (await info(first)).num_frontends:
                    break
            except grpc.aio.AioRpcError:
                pass
            assert time.monotonic() < deadline, "the frontend never attached to replica B"
            await asyncio.sleep(0.1)
        # Each replica's prefix cache records what it computed: polling num_running
        # instead races requests that finish between two polls.
        before = {addr: await cached(addr) for addr in (first, second)}
        assert before == {first: 0, second: 0}, f"replicas were not fresh: {before}"
        await asyncio.gather(
            *(stub.Generate(request(f"spread-{i}", 24), timeout=120) for i in range(6))
        )
        seen = {addr: await cached(addr) for addr in (first, second)}
        assert seen[first] > 0 and seen[second] > 0, f"load did not spread: {seen}"

        stream = stub.GenerateStream(request("victim", 400), timeout=120)
        await stream.read()  # the first chunk: the request is running somewhere
        victim = first if await running(first) else second
        proc = stack.procs["scheduler"] if victim == first else replica_b
        proc.send_signal(signal.SIGKILL)
        # The stream's 400 tokens would take far longer than the call's deadline is left
        # to run: it must end in UNAVAILABLE from the kill, not in its finish.
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            while await stream.read() is not grpc.aio.EOF:
                pass
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        again = await stub.Generate(request("after-kill", 8), timeout=60)
        assert len(again.outputs[0].output_ids) == 8


def test_requests_spread_and_a_killed_replica_fails_fast(two_schedulers) -> None:
    stack, second, replica_b = two_schedulers
    asyncio.run(spread_then_kill(stack, second, replica_b))
