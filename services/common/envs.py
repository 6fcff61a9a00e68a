"""Every TOKENLINE_* environment variable, declared once.

Flags are the primary interface; each flag whose value may come from the
environment names its variable here, so `--help`, compose files and k8s
manifests agree. Values are parsed once at start and a bad value is an error
that names the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    help: str


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("TOKENLINE_MODEL", "model directory (HF layout)"),
        EnvVar("TOKENLINE_HOST", "address a service binds to"),
        EnvVar("TOKENLINE_PORT", "gRPC (or HTTP for the gateway) port"),
        EnvVar("TOKENLINE_METRICS_PORT", "Prometheus /metrics port (0 disables)"),
        EnvVar("TOKENLINE_FRONTEND_ADDR", "frontend gRPC address host:port"),
        EnvVar("TOKENLINE_SCHEDULER_ADDRS", "comma-separated scheduler gRPC addresses"),
        EnvVar("TOKENLINE_DETOKENIZER_ADDR", "detokenizer gRPC address host:port"),
        EnvVar("TOKENLINE_DTYPE", "model dtype: auto, bfloat16, float16, float32"),
        EnvVar("TOKENLINE_DEVICE", "torch device: cpu or cuda"),
        EnvVar("TOKENLINE_ENGINE", "scheduler engine: process (its own) or thread"),
        EnvVar(
            "TOKENLINE_MODEL_IMPL",
            "scheduler: model code, auto (native where it exists), native or transformers",
        ),
        EnvVar("TOKENLINE_CHAT_TEMPLATE", "frontend: a Jinja chat template file to use"),
        EnvVar(
            "TOKENLINE_KERNELS_DIR",
            "scheduler: prebuilt CPU kernels, one library per ISA level (the image's)",
        ),
        EnvVar(
            "TOKENLINE_BATCH_INVARIANT",
            "1: each request's output is independent of its batch (scheduler, slower)",
        ),
        EnvVar("TOKENLINE_QUANTIZATION", "scheduler: weight quantization, none, int8 or w8a8"),
        EnvVar(
            "TOKENLINE_DECODE_COPY",
            "scheduler: bf16 weights also in the decode kernel's layout (true or false; "
            "unset: where they fit a quarter of the memory)",
        ),
        EnvVar(
            "TOKENLINE_BUILD_KERNELS",
            "scheduler: 1 to compile the CPU kernels at start when none fit this machine",
        ),
        EnvVar("TOKENLINE_API_KEY", "gateway and frontend: one fixed admin API key"),
        EnvVar(
            "TOKENLINE_API_KEY_FILE",
            "gateway and frontend: TOML file of named API keys (reread on change or SIGHUP)",
        ),
        EnvVar("TOKENLINE_CLUSTER_TOKEN", "secret every service presents on internal RPCs"),
        EnvVar("TOKENLINE_CLUSTER_TOKEN_FILE", "file holding TOKENLINE_CLUSTER_TOKEN"),
        EnvVar("TOKENLINE_LOG_LEVEL", "logging level"),
        EnvVar("TOKENLINE_LOG_JSON", "1 for JSON log lines"),
        EnvVar("TOKENLINE_DRAIN_TIMEOUT", "seconds to finish in-flight work on SIGTERM"),
        EnvVar("TOKENLINE_MAX_BODY_BYTES", "gateway request body limit in bytes (0 disables)"),
        EnvVar(
            "TOKENLINE_REQUEST_TIMEOUT", "gateway per-request gRPC deadline in seconds (0: none)"
        ),
        EnvVar(
            "TOKENLINE_MULTIPLEX",
            "gateway: 0 for one frontend RPC per stream instead of one Multiplex call",
        ),
        EnvVar(
            "TOKENLINE_SSE_KEEPALIVE",
            "gateway: seconds a stream may stay silent before a keep-alive (0: none)",
        ),
        EnvVar("TOKENLINE_TOOL_CALL_PARSER", "frontend: tool-call syntax to read (hermes, ...)"),
        EnvVar("TOKENLINE_REASONING_PARSER", "frontend: reasoning syntax to read (qwen3, ...)"),
        EnvVar("TOKENLINE_TLS_CERT", "PEM certificate a service serves (turns TLS on)"),
        EnvVar("TOKENLINE_TLS_KEY", "PEM private key of TOKENLINE_TLS_CERT"),
        EnvVar("TOKENLINE_TLS_CA", "PEM CA bundle verifying servers and, with mTLS, clients"),
        EnvVar(
            "TOKENLINE_TLS_CLIENT_AUTH", "none or require (mTLS: refuse clients without a cert)"
        ),
        EnvVar("TOKENLINE_TLS_CLIENT_CERT", "PEM client certificate (default: TOKENLINE_TLS_CERT)"),
        EnvVar("TOKENLINE_TLS_CLIENT_KEY", "PEM private key of TOKENLINE_TLS_CLIENT_CERT"),
        EnvVar("TOKENLINE_TLS_SERVER_NAME", "name servers' certificates are verified against"),
    )
}


TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def env_default(name: str, default: Any, parse: Callable[[str], Any] = str) -> Any:
    """The parsed value of a declared variable, or ``default`` when unset."""
    if name not in ENV_VARS:
        raise KeyError(f"undeclared environment variable {name}; add it to ENV_VARS")
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise SystemExit(f"bad value for {name}={raw!r}: {exc}") from exc
