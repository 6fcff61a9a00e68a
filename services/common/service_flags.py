"""What every gRPC service's command line shares, defined once: the model, the bind
address, the metrics port, the drain timeout, logging, TLS and the cluster token; and
how a service's ``main`` runs."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from services.common.auth.cluster_token import add_cluster_token_flag, pop_cluster_token
from services.common.envs import env_default
from services.common.logs import add_logging_args, setup_logging
from services.common.tls import TlsSettings, add_tls_flags, pop_tls_settings


def service_parser(
    prog: str, description: str | None, default_port: int
) -> argparse.ArgumentParser:
    """A parser with the shared flags; the service adds its own."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument(
        "--model",
        default=env_default("TOKENLINE_MODEL", "models/tokenline-tiny"),
        help="Hugging Face model directory (config.json, safetensors, tokenizer)",
    )
    p.add_argument(
        "--host", default=env_default("TOKENLINE_HOST", "127.0.0.1"), help="address to bind"
    )
    p.add_argument(
        "--port",
        type=int,
        default=env_default("TOKENLINE_PORT", default_port, int),
        help="gRPC port",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=env_default("TOKENLINE_METRICS_PORT", 0, int),
        help="Prometheus /metrics on its own port (0: off)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=env_default("TOKENLINE_DRAIN_TIMEOUT", 30.0, float),
        help="seconds in-flight work may take to finish after SIGTERM",
    )
    add_logging_args(p)
    add_tls_flags(p)
    add_cluster_token_flag(p)
    return p


def parse_service_args(
    p: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[dict[str, Any], TlsSettings]:
    """The parsed flags as keyword arguments for the service's config (the cluster token
    as ``cluster_token``), and its TLS."""
    args = p.parse_args(argv)
    tls = pop_tls_settings(args)
    token = pop_cluster_token(args)
    return {**vars(args), "cluster_token": token}, tls


class _LoggedConfig(Protocol):
    @property
    def log_level(self) -> str: ...

    @property
    def log_json(self) -> bool: ...


C = TypeVar("C", bound=_LoggedConfig)


def run_service(parse: Callable[[], C], serve: Callable[[C], Coroutine[Any, Any, None]]) -> None:
    """Parse, set up logging, serve until SIGTERM."""
    config = parse()
    setup_logging(config.log_level, config.log_json)
    asyncio.run(serve(config))
