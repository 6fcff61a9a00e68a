"""SIGTERM mid-stream: the stream completes, new requests are refused, exit 0."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenline.v1 import common_pb2, frontend_pb2_grpc, generate_pb2

from services.launch import LocalStack, StackPorts
from tests.live_stack import dump_logs
from tests.waiting import eventually

pytestmark = pytest.mark.live

NEW_TOKENS = 48
# A drain ends when its work is done, not when its timeout runs out: with a timeout this
# long, waiting out the timeout (e.g. for the frontends' lease streams, which never end by
# themselves) overruns EXIT_WAIT_S and fails the test. Both are bounds on a failure only.
DRAIN_TIMEOUT_S = 600
EXIT_WAIT_S = 60


@pytest.fixture
def stack(default_model_dir: Path, tmp_path: Path) -> Iterator[LocalStack]:
    stack = LocalStack(
        str(default_model_dir),
        StackPorts.free(),
        scheduler_args=["--num-threads", "1", "--drain-timeout", str(DRAIN_TIMEOUT_S)],
        frontend_args=["--drain-timeout", str(DRAIN_TIMEOUT_S)],
        log_dir=tmp_path,
    )
    stack.start()
    yield stack
    stack.stop()
    dump_logs(tmp_path)


def generate_request(rid: str) -> generate_pb2.GenerateReqInput:
    return generate_pb2.GenerateReqInput(
        rid=rid,
        text=["Once upon a time"],
        sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True
        ),
    )


async def is_draining(channel: grpc.aio.Channel) -> bool:
    """The process has begun its drain: its health says NOT_SERVING, or it takes no new
    call at all. It flips health and starts refusing work in one step of its event
    loop (GrpcProcess.serve_until_signal), so either answer means work is refused."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    except grpc.aio.AioRpcError:
        return True
    return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def stream_through_sigterm(stack: LocalStack, victim: str) -> None:
    async with grpc.aio.insecure_channel(stack.addr("frontend")) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        call = stub.GenerateStream(generate_request("drain-1"))
        ids: list[int] = []
        finish = None
        async for response in call:
            if not ids:
                stack.procs[victim].send_signal(signal.SIGTERM)
                async with grpc.aio.insecure_channel(stack.addr(victim)) as health:
                    await eventually(lambda: is_draining(health), 10, f"{victim} draining")
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(generate_request("drain-2"), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            for out in response.outputs:
                ids.extend(out.output_ids)
                if out.HasField("finish_reason"):
                    finish = out.finish_reason
        assert finish is not None and finish.kind == common_pb2.FinishReason.KIND_LENGTH
        assert len(ids) == NEW_TOKENS


@pytest.mark.parametrize("victim", ["scheduler", "frontend"])
def test_sigterm_mid_stream_completes_it_refuses_new_work_and_exits_zero(
    stack: LocalStack, victim: str
) -> None:
    asyncio.run(stream_through_sigterm(stack, victim))
    assert stack.procs[victim].wait(timeout=EXIT_WAIT_S) == 0
