"""`python -m services.scheduler --model DIR --port N --detokenizer-addr D`"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.envs import env_default, parse_bool
from services.common.rpc.drain import work_methods
from services.common.rpc.server import GrpcProcess, wait_until
from services.common.service_flags import parse_service_args, run_service, service_parser
from services.scheduler.core.commands import AbortStartedCommand
from services.scheduler.core.messages import RUNNERS
from services.scheduler.core.stats import SchedulerStats
from services.scheduler.model_executor.models.dtype import AUTO, DTYPES
from services.scheduler.model_executor.models.model_impl import (
    MODEL_IMPLS,
    ModelImpl,
    UnsupportedModelError,
    resolve_model_impl,
)
from services.scheduler.model_executor.models.quantization import (
    QUANTIZATIONS,
    QuantizationError,
    check_quantization,
)
from services.scheduler.transport.detokenizer_pusher import DetokenizerPusher
from services.scheduler.transport.engine_build import SchedulerProcessConfig, build_scheduler
from services.scheduler.transport.engine_client import EngineClient, RowSink
from services.scheduler.transport.engine_process import EngineLaunch
from services.scheduler.transport.engine_thread import EngineThread
from services.scheduler.transport.metrics import SchedulerMetrics
from services.scheduler.transport.servicer import SchedulerServicer

logger = logging.getLogger(__name__)
SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"]
# Refused while draining (services/common/rpc/drain.py): each hands the engine new work.
WORK_METHODS = ("AddRequest", "AddRequests", "OpenSession")
# What RPCs still open after a finished drain get: the lease streams never end by
# themselves, and a unary call (GetInfo) needs far less.
GRACE_AFTER_DRAIN_S = 1.0


def parse_args(argv: list[str] | None = None) -> SchedulerProcessConfig:
    args, tls = parse_service_args(create_parser(), argv)
    return SchedulerProcessConfig(**args, tls=tls)


def create_parser() -> argparse.ArgumentParser:
    """The scheduler's flags, built without parsing (the flags reference reads it too)."""
    p = service_parser("tokenline-scheduler", __doc__, default_port=50052)
    p.add_argument(
        "--detokenizer-addr",
        default=env_default("TOKENLINE_DETOKENIZER_ADDR", "127.0.0.1:50053"),
        help="detokenizer gRPC address host:port, where each step's token rows go",
    )
    p.add_argument(
        "--dtype",
        choices=[AUTO, *DTYPES],
        default=env_default("TOKENLINE_DTYPE", AUTO),
        help="auto: the checkpoint's dtype where the hardware computes it natively "
        "(bf16 on CPU needs AVX512_BF16 or AMX), else float32 on CPU, float16 on CUDA",
    )
    p.add_argument(
        "--device", default=env_default("TOKENLINE_DEVICE", "cpu"), help="torch device: cpu or cuda"
    )
    p.add_argument(
        "--engine",
        choices=["process", "thread"],
        default=env_default("TOKENLINE_ENGINE", "process"),
        help="run the engine in its own process (default), or on a thread of this one",
    )
    p.add_argument(
        "--attention-backend",
        choices=["torch", "flash_attn"],
        default="torch",
        help="torch: SDPA (CPU and GPU); flash_attn: vllm-flash-attn or flash-attn (GPU only)",
    )
    p.add_argument(
        "--model-impl",
        choices=MODEL_IMPLS,
        default=env_default("TOKENLINE_MODEL_IMPL", "auto"),
        help="native: tokenline's own model code; transformers: the architecture's "
        "transformers code with tokenline's attention and KV cache; auto: native where it "
        "exists, else transformers",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=env_default("TOKENLINE_BATCH_INVARIANT", False, parse_bool),
        help="make each request's output independent of what else is in its batch (fixed "
        "row tiles in every matmul, decode attention per request), at a measured cost: "
        "docs/batch-invariance.md",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=env_default("TOKENLINE_QUANTIZATION", "none"),
        help="int8: every linear projection's weight and the LM head held as int8, one "
        "scale per output channel (native models on CPU; faster decode, less memory, "
        "slightly different logits); w8a8: the same weights, and every matmul's "
        "activations quantized to int8 per row (AVX512-VNNI CPUs; faster prefill and "
        "batches too, more error): docs/quantization.md",
    )
    p.add_argument(
        "--decode-copy",
        action=argparse.BooleanOptionalAction,
        default=env_default("TOKENLINE_DECODE_COPY", None, parse_bool),
        help="bf16 on a CPU with AVX512-BF16: keep each linear weight in the layout of the "
        "engine's decode kernel. With AMX a second copy, which steps of up to 4 rows use "
        "(one request's decode forward 1.2x faster on the AMX Xeon); unset, kept where it "
        "takes at most a quarter of the memory the process may use (its cgroup's limit or "
        "the machine's). Without AMX it takes every step in place of oneDNN's packed "
        "weight, and unset, it is always kept: docs/scheduler.md#decode-copy",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=0,
        help="KV pool size in tokens (overrides --kv-cache-memory-mb)",
    )
    p.add_argument(
        "--kv-cache-memory-mb",
        type=int,
        default=512,
        help="KV pool size as a memory budget (K and V of every layer), allocated once at start",
    )
    p.add_argument(
        "--build-kernels",
        action=argparse.BooleanOptionalAction,
        default=env_default("TOKENLINE_BUILD_KERNELS", False, parse_bool),
        help="on CPU, compile the sampler and decode-attention kernels into MODEL/kernels at "
        "start when none fit this machine (needs a C++ compiler; `make kernels` does it "
        "ahead of time; without them those steps run eagerly)",
    )
    p.add_argument(
        "--kernels-dir",
        default=env_default("TOKENLINE_KERNELS_DIR", ""),
        help="a folder of prebuilt CPU kernels, one library per ISA level (the container "
        "image's); read after MODEL/kernels",
    )
    p.add_argument(
        "--runner",
        choices=RUNNERS,
        default="generate",
        help="generate: every request kind; pooling: only pooling (embedding) requests, "
        "so chat and completions are refused (INVALID_ARGUMENT) and nothing decodes "
        "(vLLM's name)",
    )
    p.add_argument(
        "--disable-prefix-cache",
        action="store_true",
        help="do not share KV of common prefixes across requests (radix cache off)",
    )
    _add_batching_flags(p)
    return p


def _add_batching_flags(p: argparse.ArgumentParser) -> None:
    """How many requests and tokens a step takes, and how often rows go out."""
    p.add_argument(
        "--max-running-requests", type=int, default=64, help="requests in the running batch"
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=4096,
        help="requests held (running and waiting); past it a new one is refused at once "
        "(RESOURCE_EXHAUSTED, HTTP 429)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=1024,
        help="tokens per step: prefill chunks plus one per decoding request",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=0,
        help="override the model's context length (0: from config.json)",
    )
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: auto)")
    p.add_argument(
        "--heap-tuning",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CPU, keep the engine's freed memory in glibc's heap instead of unmapping "
        "each large tensor after every step (~1.3x prefill on an AMX Xeon; "
        "services/scheduler/transport/heap.py)",
    )
    p.add_argument(
        "--overlap-schedule",
        action="store_true",
        help="launch the next decode step on a forward worker thread before committing the "
        "one in flight, so scheduling and output work hide behind the forward",
    )
    p.add_argument(
        "--stream-interval",
        type=_at_least_one,
        default=1,
        help="a streamed request's tokens go out every N steps (its first at once); "
        "unary requests send only their final row",
    )


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def resolve_or_exit(config: SchedulerProcessConfig) -> ModelImpl:
    """The path that serves the model; a checkpoint none can run, or a --quantization it
    cannot, ends the process here, with one line and before any weight or kernel work."""
    try:
        impl = resolve_model_impl(config.model, config.model_impl)
        check_quantization(config.quantization, torch.device(config.device), impl.path)
    except (UnsupportedModelError, QuantizationError) as exc:
        raise SystemExit(f"tokenline-scheduler: {exc}") from None
    if impl.headless and config.runner != "pooling":
        raise SystemExit(
            f"tokenline-scheduler: model {Path(config.model).name} is a {impl.architecture} "
            "checkpoint, a model body without an LM head: it can only embed; start it "
            "with --runner pooling"
        )
    return impl


async def serve(config: SchedulerProcessConfig) -> None:
    impl = resolve_or_exit(config)
    # Forked first, before gRPC or anything else starts a thread (transport/engine_process.py).
    launch = EngineLaunch(config) if config.engine == "process" else None
    process = GrpcProcess(
        host=config.host,
        port=config.port,
        service_names=[SERVICE.full_name],
        metrics_port=config.metrics_port,
        tls=config.tls,
        interceptors=config.cluster_token.server_interceptors(),
        work_methods=work_methods(SERVICE, WORK_METHODS),
    )
    model_name = Path(config.model).resolve().name
    servicer = SchedulerServicer(
        model_name,
        metrics_port=config.metrics_port,
        architecture=impl.architecture,
        model_impl=impl.path,
    )
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, process.server)
    # Liveness answers while the model loads; readiness waits for it.
    await process.start()
    metrics = SchedulerMetrics(model_name)
    pusher = DetokenizerPusher(
        config.detokenizer_addr,
        on_stream_lost=lambda reason: engine.tell(AbortStartedCommand(reason)),
        tls=config.tls,
        cluster_token=config.cluster_token,
    )
    pusher.start()
    loop = asyncio.get_running_loop()

    def on_fatal() -> None:
        # An engine that died takes the scheduler down, so its supervisor restarts both.
        loop.call_soon_threadsafe(process.request_stop)

    engine, dtype = await start_engine(
        config, launch, sink=pusher.publish, on_stats=metrics.record, on_fatal=on_fatal
    )
    metrics.track(lambda: engine.stats)
    engine.start()
    servicer.attach(engine, engine.limits.context_length, dtype)
    await process.set_ready(True)

    async def drain() -> None:
        # New work is refused at the gate; the calls that got past it before it closed
        # reach the engine first, then what is queued and running finishes and its rows
        # are delivered.
        await process.drain_gate.wait_idle(config.drain_timeout)
        await wait_until(
            lambda: engine.fatal_error is not None or (engine.is_idle and pusher.is_flushed),
            config.drain_timeout,
        )

    # Once drained, only the frontends' lease streams are left open: they end with the stop.
    await process.serve_until_signal(
        config.drain_timeout, on_drain=drain, grace_after_drain=GRACE_AFTER_DRAIN_S
    )
    await pusher.close()
    engine.stop()
    if engine.fatal_error is not None:
        raise SystemExit(f"engine failed: {engine.fatal_error}")


async def start_engine(
    config: SchedulerProcessConfig,
    launch: EngineLaunch | None,
    sink: RowSink,
    on_stats: Callable[[SchedulerStats], None],
    on_fatal: Callable[[], None],
) -> tuple[EngineClient, str]:
    """The engine in its own process (``launch``, from ``--engine process``, the default)
    or on a thread of this one; returns it with the dtype the model runs in."""
    if launch is not None:
        engine = await launch.ready(sink, on_stats, on_fatal)
        return engine, engine.dtype
    scheduler, dtype = await asyncio.to_thread(build_scheduler, config)
    return EngineThread(scheduler, sink, on_stats=on_stats, on_fatal=on_fatal), dtype


def main() -> None:
    run_service(parse_args, serve)


if __name__ == "__main__":
    main()
