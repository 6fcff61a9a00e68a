"""`tokenline healthcheck --addr HOST:PORT [--service NAME]`: a gRPC health probe.

Exit 0 when the service reports SERVING, 1 otherwise. Used by docker-compose
healthchecks, and by Kubernetes exec probes when TLS is on (its native gRPC probe
speaks plaintext only). Takes the services' ``--tls-*`` flags / ``TOKENLINE_TLS_*``.
"""

from __future__ import annotations

import argparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.rpc.server import READINESS_SERVICE
from services.common.tls import add_tls_flags, open_sync_channel, pop_tls_settings


def create_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenline healthcheck", description=__doc__)
    p.add_argument("--addr", required=True, help="host:port of a tokenline gRPC service")
    p.add_argument(
        "--service",
        default=READINESS_SERVICE,
        help='health service name ("" = liveness of the whole server)',
    )
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    add_tls_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = create_parser().parse_args(argv)
    tls = pop_tls_settings(args)
    try:
        with open_sync_channel(args.addr, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as exc:
        print(f"{args.addr}: {exc.code().name}")
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.addr} {args.service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main())
