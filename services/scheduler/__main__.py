"""`python -m services.scheduler --model DIR --port N --detokenizer-addr D`"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenline.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.envs import env_default
from services.common.grpc_server import GrpcProcess, wait_until
from services.common.service_flags import parse_service_args, run_service, service_parser
from services.common.tls import TlsSettings
from services.common.tokenizer import load_tokenizer
from services.scheduler.detokenizer_pusher import DetokenizerPusher
from services.scheduler.engine import Scheduler, SchedulerConfig
from services.scheduler.engine_thread import EngineThread
from services.scheduler.kv_pool import KVPool
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.dtype import AUTO, DTYPES, choose_dtype
from services.scheduler.model.loader import load_model
from services.scheduler.server import SchedulerServicer
from services.scheduler.stop_checker import StopChecker

logger = logging.getLogger(__name__)
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


@dataclass(frozen=True, slots=True)
class SchedulerProcessConfig:
    model: str
    host: str
    port: int
    metrics_port: int
    detokenizer_addr: str
    dtype: str
    device: str
    attention_backend: str
    kv_cache_tokens: int
    kv_cache_memory_mb: int
    max_running_requests: int
    max_waiting_requests: int
    max_num_batched_tokens: int
    context_length: int
    disable_prefix_cache: bool
    num_threads: int
    stream_interval: int
    drain_timeout: float
    log_level: str
    log_json: bool
    tls: TlsSettings


def parse_args(argv: list[str] | None = None) -> SchedulerProcessConfig:
    p = service_parser("tokenline-scheduler", __doc__, default_port=50052)
    p.add_argument(
        "--detokenizer-addr", default=env_default("TOKENLINE_DETOKENIZER_ADDR", "127.0.0.1:50053")
    )
    p.add_argument(
        "--dtype",
        choices=[AUTO, *DTYPES],
        default=env_default("TOKENLINE_DTYPE", AUTO),
        help="auto: the checkpoint's dtype where the hardware computes it natively "
        "(bf16 on CPU needs AVX512_BF16 or AMX), else float32 on CPU, float16 on CUDA",
    )
    p.add_argument("--device", default=env_default("TOKENLINE_DEVICE", "cpu"))
    p.add_argument("--attention-backend", choices=["torch", "flash_attn"], default="torch")
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
        "--disable-prefix-cache",
        action="store_true",
        help="do not share KV of common prefixes across requests (radix cache off)",
    )
    _add_batching_flags(p)
    args, tls = parse_service_args(p, argv)
    return SchedulerProcessConfig(**args, tls=tls)


def _add_batching_flags(p: argparse.ArgumentParser) -> None:
    """How many requests and tokens a step takes, and how often rows go out."""
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-waiting-requests", type=int, default=4096)
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


def build_engine(config: SchedulerProcessConfig) -> tuple[Scheduler, int, str]:
    """Load the model and size the KV pool; returns the scheduler, context length and
    the name of the dtype the model runs in."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device)
    choice = choose_dtype(config.dtype, ModelConfig.from_dir(config.model).dtype, device)
    model, model_config = load_model(config.model, choice.dtype, device, config.attention_backend)
    logger.info("model %s in %s on %s (%s)", config.model, choice.name, device, choice.reason)
    kv_pool = create_kv_pool(config, model_config, choice.dtype, device)
    context = config.context_length or model_config.max_context_len
    if kv_pool.num_tokens < context:
        # One request's KV must fit the pool, so the pool bounds the context; GetInfo
        # reports this figure and the frontends validate against it.
        logger.info("context length %d capped to the KV pool's %d", context, kv_pool.num_tokens)
        context = kv_pool.num_tokens
    stop_checker = StopChecker(
        load_tokenizer(config.model), set(model_config.eos_token_ids), context
    )
    scheduler = Scheduler(
        model,
        kv_pool,
        stop_checker,
        SchedulerConfig(
            max_running_requests=config.max_running_requests,
            max_waiting_requests=config.max_waiting_requests,
            max_num_batched_tokens=config.max_num_batched_tokens,
            context_length=context,
            enable_prefix_cache=not config.disable_prefix_cache,
            stream_interval=config.stream_interval,
        ),
        device,
    )
    return scheduler, context, choice.name


def create_kv_pool(
    config: SchedulerProcessConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> KVPool:
    """The KV pool, sized by --kv-cache-tokens or else --kv-cache-memory-mb."""
    shape = (model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype)
    per_token = KVPool.bytes_per_token(*shape)
    num_tokens = config.kv_cache_tokens or KVPool.tokens_for_budget(
        config.kv_cache_memory_mb * 2**20, *shape
    )
    if num_tokens < 1:
        raise SystemExit(
            f"KV pool of {num_tokens} tokens: raise --kv-cache-tokens or --kv-cache-memory-mb "
            f"(one token takes {per_token} bytes)"
        )
    logger.info("KV pool %d tokens (%.1f MiB)", num_tokens, num_tokens * per_token / 2**20)
    return KVPool(num_tokens, *shape, device)


async def serve(config: SchedulerProcessConfig) -> None:
    process = GrpcProcess(
        host=config.host,
        port=config.port,
        service_names=[SERVICE_NAME],
        metrics_port=config.metrics_port,
        tls=config.tls,
    )
    model_name = Path(config.model).resolve().name
    servicer = SchedulerServicer(model_name, metrics_port=config.metrics_port)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, process.server)
    # Liveness answers while the model loads; readiness waits for it.
    await process.start()
    scheduler, context, dtype = await asyncio.to_thread(build_engine, config)
    metrics = SchedulerMetrics(model_name)
    pusher = DetokenizerPusher(
        config.detokenizer_addr,
        on_stream_lost=lambda reason: engine.abort_started(reason),
        tls=config.tls,
    )
    pusher.start()
    engine = EngineThread(scheduler, sink=pusher.publish, on_stats=metrics.record)
    metrics.track(lambda: engine.stats)
    engine.start()
    servicer.attach(engine, context, dtype)
    await process.set_ready(True)

    async def drain() -> None:
        # Refuse new work, finish what is queued and running, deliver its rows.
        servicer.draining = True
        await wait_until(lambda: engine.is_idle and pusher.is_flushed, config.drain_timeout)

    await process.serve_until_signal(config.drain_timeout, on_drain=drain)
    await pusher.close()
    engine.stop()


def main() -> None:
    run_service(parse_args, serve)


if __name__ == "__main__":
    main()
