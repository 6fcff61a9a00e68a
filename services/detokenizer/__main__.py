"""`python -m services.detokenizer --model DIR --port N`"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tokenline.v1 import detokenizer_pb2, detokenizer_pb2_grpc

from services.common.auth.cluster_token import ClusterToken
from services.common.rpc.server import GrpcProcess, wait_until
from services.common.service_flags import parse_service_args, run_service, service_parser
from services.common.tls import TlsSettings
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
    cluster_token: ClusterToken
    tls: TlsSettings


def parse_args(argv: list[str] | None = None) -> DetokenizerConfig:
    args, tls = parse_service_args(create_parser(), argv)
    return DetokenizerConfig(**args, tls=tls)


def create_parser() -> argparse.ArgumentParser:
    """The detokenizer's flags, built without parsing (the flags reference reads it too)."""
    p = service_parser("tokenline-detokenizer", __doc__, default_port=50053)
    p.add_argument(
        "--max-decode-states",
        type=int,
        default=65536,
        help="live DecodeStatus entries; a new request past this is refused (never evicted)",
    )
    return p


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
        interceptors=config.cluster_token.server_interceptors(),
    )
    metrics = DetokenizerMetrics()
    servicer = DetokenizerServicer(
        manager, on_batch=metrics.observe_batch, metrics_port=config.metrics_port
    )
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
    run_service(parse_args, serve)


if __name__ == "__main__":
    main()
