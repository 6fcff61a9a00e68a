"""The floor of one streamed token's gRPC hop: grpc.aio server streaming with nothing else.

A server process streams ``messages`` ``CompletionChunk`` messages (the frontend's per-token
message to the gateway) on each of ``streams`` concurrent calls, all of them once every
``step_s`` as an engine step would; a client in this process reads them all. Reported: CPU
microseconds per message on each side, read from /proc and ``time.process_time``.
``bench.split`` prints these beside the gateway's and frontend's CPU per token.

    python -m bench.grpc_floor [--streams 64] [--messages 64] [--step-ms 30]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from tokenline.v1 import openai_pb2

from bench.machine import describe, machine_info
from bench.procs import cpu_seconds
from services.launch import free_port

_METHOD = "/bench.Floor/Stream"


def _chunk() -> openai_pb2.CompletionChunk:
    chunk = openai_pb2.CompletionChunk(id="cmpl-floor", model="tokenline-tiny", created=1)
    chunk.choices.add(index=0, text=" token")
    return chunk


async def _serve(port: int, messages: int, step_s: float, ready: Any) -> None:
    """Every open stream gets its next message at each step tick."""
    waiting: list[asyncio.Future[None]] = []

    async def tick() -> None:
        while True:
            await asyncio.sleep(step_s)
            due, waiting[:] = list(waiting), []
            for future in due:
                future.set_result(None)

    async def stream(_: Any, __: Any) -> AsyncIterator[openai_pb2.CompletionChunk]:
        loop = asyncio.get_running_loop()
        for _ in range(messages):
            waiting.append(loop.create_future())
            await waiting[-1]
            yield _chunk()

    handler = grpc.unary_stream_rpc_method_handler(
        stream,
        request_deserializer=openai_pb2.CompletionRequest.FromString,
        response_serializer=openai_pb2.CompletionChunk.SerializeToString,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("bench.Floor", {"Stream": handler})]
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ticker = asyncio.create_task(tick())
    ready.set()
    await server.wait_for_termination()
    ticker.cancel()


def _server_main(port: int, messages: int, step_s: float, ready: Any) -> None:
    asyncio.run(_serve(port, messages, step_s, ready))


async def _read_all(port: int, streams: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(
            _METHOD,
            request_serializer=openai_pb2.CompletionRequest.SerializeToString,
            response_deserializer=openai_pb2.CompletionChunk.FromString,
        )

        async def one() -> int:
            return sum([1 async for _ in call(openai_pb2.CompletionRequest())])

        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def measure_floor(streams: int = 64, messages: int = 64, step_s: float = 0.03) -> dict[str, float]:
    """CPU µs per message of the reading client and of the writing server (one warm-up run,
    then one measured run)."""
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_server_main, args=(port, messages, step_s, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the gRPC floor server did not start")
        asyncio.run(_read_all(port, 4))  # warm-up: channel, handlers
        server_start, client_start = cpu_seconds(server.pid), time.process_time()
        received = asyncio.run(_read_all(port, streams))
        client_s, server_s = (
            time.process_time() - client_start,
            cpu_seconds(server.pid) - server_start,
        )
    finally:
        server.kill()
        server.join()
    if received != streams * messages:
        raise RuntimeError(f"received {received} of {streams * messages} messages")
    return {
        "client_read_us_per_message": client_s / received * 1e6,
        "server_write_us_per_message": server_s / received * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--messages", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=30.0)
    args = p.parse_args()
    print(f"machine: {describe(machine_info())}", flush=True)
    floor = measure_floor(args.streams, args.messages, args.step_ms / 1000)
    print(
        f"grpc.aio server streaming, {args.streams} streams x {args.messages} messages: "
        f"read {floor['client_read_us_per_message']:.0f} us, "
        f"write {floor['server_write_us_per_message']:.0f} us of CPU per message"
    )


if __name__ == "__main__":
    main()
