"""Gateway flags → one frozen config, built once at start."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.auth.api_keys import add_api_key_flags
from services.common.auth.cluster_token import (
    ClusterToken,
    add_cluster_token_flag,
    pop_cluster_token,
)
from services.common.envs import env_default, parse_bool
from services.common.logs import add_logging_args
from services.common.tls import TlsSettings, add_tls_flags, pop_tls_settings

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_SSE_KEEPALIVE_S = 15.0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway process needs; never written after start."""

    host: str = "127.0.0.1"
    port: int = 8000
    frontend_addr: str = "127.0.0.1:50051"
    # Neither: no auth. Keys are compared in constant time against
    # `Authorization: Bearer <key>` (services/common/auth/api_keys.py).
    api_key: str | None = None
    api_key_file: str | None = None
    # What the gateway presents to the frontend, which then trusts the caller it names.
    cluster_token: ClusterToken = field(default_factory=ClusterToken)
    # 0 disables the limit.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # gRPC deadline for each request (a stream's whole life); None: no deadline.
    request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S
    drain_timeout_s: float = 30.0
    # Streamed chat and completions over one Multiplex call (gateway/multiplex.py);
    # False: one server-streaming RPC per request.
    multiplex: bool = True
    # Seconds a stream may stay silent before it gets a keep-alive (an SSE comment, or
    # Anthropic's ping event); None: never.
    sse_keepalive_s: float | None = DEFAULT_SSE_KEEPALIVE_S
    log_level: str = "info"
    log_json: bool = False
    # The channel to the frontend; --tls-cert/--tls-key are only its client identity here
    # (the gateway's HTTP side is not TLS: terminate HTTPS in front of it).
    tls: TlsSettings = field(default_factory=TlsSettings)


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _non_negative_float(raw: str) -> float:
    value = float(raw)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def create_parser() -> argparse.ArgumentParser:
    """Flags, each with its TOKENLINE_* fallback so manifests and --help agree."""
    p = argparse.ArgumentParser(
        prog="python -m gateway",
        description="tokenline's OpenAI-compatible REST/SSE gateway in front of the gRPC frontend",
    )
    p.add_argument(
        "--host", default=env_default("TOKENLINE_HOST", "127.0.0.1"), help="address to bind"
    )
    p.add_argument(
        "--port", type=int, default=env_default("TOKENLINE_PORT", 8000, int), help="HTTP port"
    )
    p.add_argument(
        "--frontend-addr",
        default=env_default("TOKENLINE_FRONTEND_ADDR", "127.0.0.1:50051"),
        help="frontend gRPC address host:port",
    )
    add_api_key_flags(p)
    p.add_argument(
        "--max-body-bytes",
        type=_non_negative_int,
        default=env_default("TOKENLINE_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, _non_negative_int),
        help="larger request bodies get 413; 0 disables",
    )
    p.add_argument(
        "--request-timeout",
        type=_non_negative_float,
        default=env_default(
            "TOKENLINE_REQUEST_TIMEOUT", DEFAULT_REQUEST_TIMEOUT_S, _non_negative_float
        ),
        help="seconds before a request's gRPC deadline expires (504); 0: no deadline",
    )
    p.add_argument(
        "--drain-timeout",
        type=_non_negative_float,
        default=env_default("TOKENLINE_DRAIN_TIMEOUT", 30.0, _non_negative_float),
        help="seconds in-flight requests may take to finish after SIGTERM",
    )
    p.add_argument(
        "--multiplex",
        action=argparse.BooleanOptionalAction,
        default=env_default("TOKENLINE_MULTIPLEX", True, parse_bool),
        help="stream chat and completions over one Multiplex call to the frontend "
        "(--no-multiplex: one server-streaming RPC per request)",
    )
    p.add_argument(
        "--sse-keepalive",
        type=_non_negative_float,
        default=env_default(
            "TOKENLINE_SSE_KEEPALIVE", DEFAULT_SSE_KEEPALIVE_S, _non_negative_float
        ),
        help="seconds a stream may stay silent before a keep-alive (an SSE comment; "
        "Anthropic's ping event on /v1/messages); 0: none",
    )
    add_logging_args(p, default_level="info")
    add_tls_flags(p)
    add_cluster_token_flag(p)
    return p


def config_from_args(argv: Sequence[str] | None = None) -> GatewayConfig:
    """Parse flags (and env fallbacks) into the frozen config."""
    args = create_parser().parse_args(argv)
    cluster_token = pop_cluster_token(args)
    return GatewayConfig(
        host=args.host,
        port=args.port,
        frontend_addr=args.frontend_addr,
        api_key=args.api_key or None,
        api_key_file=args.api_key_file,
        cluster_token=cluster_token,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout or None,
        drain_timeout_s=args.drain_timeout,
        multiplex=args.multiplex,
        sse_keepalive_s=args.sse_keepalive or None,
        log_level=args.log_level.lower(),
        log_json=args.log_json,
        tls=pop_tls_settings(args),
    )
