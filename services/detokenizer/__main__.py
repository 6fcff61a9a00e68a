"""`python -m services.detokenizer --model DIR --port N`"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

from tokenline.v1 import detokenizer_pb2, detokenizer_pb2_grpc

from services.common.envs import env_default
from services.common.grpc_server import GrpcProcess, wait_until
from services.common.logs import add_logging_args, setup_logging
from services.common.tls import TlsSettings, add_tls_flags, pop_tls_settings
from services.common.tokenizer import load_tokenizer
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.metrics import DetokenizerMetrics
from services.detokenizer.server import DetokenizerServicer
from services.detokenizer.text_decoder import TextDecoder

SERVICE_NAME = detokenizer_pb2.DESCRIPTOR.services_by_name["DetokenizerService"].full_name


@dataclass(frozen=True, slots=True)
class DetokenizerConfig:
    model: str
    host: str
    port: int
    metrics_port: int
    max_decode_states: int
    drain_timeout: float
    log_level: str
    log_json: bool
    tls: TlsSettings


def parse_args(argv: list[str] | None = None) -> DetokenizerConfig:
    p = argparse.ArgumentParser(prog="tokenline-detokenizer", description=__doc__)
    p.add_argument("--model", default=env_default("TOKENLINE_MODEL", "models/tokenline-tiny"))
    p.add_argument("--host", default=env_default("TOKENLINE_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env_default("TOKENLINE_PORT", 50053, int))
    p.add_argument(
        "--metrics-port", type=int, default=env_default("TOKENLINE_METRICS_PORT", 0, int)
    )
    p.add_argument(
        "--max-decode-states",
        type=int,
        default=65536,
        help="live DecodeStatus entries; a new request past this is refused (never evicted)",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=env_default("TOKENLINE_DRAIN_TIMEOUT", 30.0, float)
    )
    add_logging_args(p)
    add_tls_flags(p)
    args = p.parse_args(argv)
    tls = pop_tls_settings(args)
    return DetokenizerConfig(**vars(args), tls=tls)


async def serve(config: DetokenizerConfig) -> None:
    if config.max_decode_states < 1:
        raise SystemExit("--max-decode-states must be at least 1")
    decoder = TextDecoder(load_tokenizer(config.model))
    manager = DetokenizerManager(decoder, config.max_decode_states)
    process = GrpcProcess(
        host=config.host,
        port=config.port,
        service_names=[SERVICE_NAME],
        metrics_port=config.metrics_port,
        tls=config.tls,
    )
    metrics = DetokenizerMetrics()
    servicer = DetokenizerServicer(manager, on_batch=metrics.observe_batch)
    detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(servicer, process.server)
    metrics.track(manager, servicer)
    await process.start()
    await process.set_ready(True)

    async def drain() -> None:
        # Requests in flight finish first; then subscriptions end so stop() need not wait.
        await wait_until(lambda: not manager.states, config.drain_timeout)
        servicer.close_subscriptions()

    await process.serve_until_signal(config.drain_timeout, on_drain=drain)


def main() -> None:
    config = parse_args()
    setup_logging(config.log_level, config.log_json)
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
