"""The whole stack with mTLS on every gRPC hop (gateway → frontend → scheduler →
detokenizer → frontend), certificates made by the ``tls_certs`` fixture and handed to
all four processes as ``--tls-*`` flags. The module's own ``stack`` replaces the shared
plaintext one, so the ``client`` fixture (tests/integration/conftest.py) talks to it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import healthcheck
from services.common.tls import TlsSettings, open_sync_channel
from services.launch import LocalStack
from tests.live_stack import running_stack
from tests.tls_certs import CertFiles

pytestmark = pytest.mark.live

GRPC_SERVICES = ("frontend", "scheduler", "detokenizer")


def mtls_settings(certs: CertFiles) -> TlsSettings:
    """Each service serves the server cert and dials with the client cert."""
    return TlsSettings(
        cert=str(certs.server_cert),
        key=str(certs.server_key),
        ca=str(certs.ca),
        client_auth="require",
        client_cert=str(certs.client_cert),
        client_key=str(certs.client_key),
    )


@pytest.fixture(scope="module")
def stack(
    default_model_dir: Path,
    tls_certs: CertFiles,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalStack]:
    with running_stack(
        default_model_dir,
        tmp_path_factory.mktemp("tls-stack-logs"),
        request,
        scheduler_args=["--kv-cache-tokens", "4096", "--num-threads", "1"],
        tls=mtls_settings(tls_certs),
    ) as stack:
        yield stack


def test_chat_completion_through_every_tls_hop(client: openai.OpenAI, model_id: str) -> None:
    reply = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Hello"}], max_tokens=8
    )
    choice = reply.choices[0]
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")


def health_code(addr: str, tls: TlsSettings | None) -> grpc.StatusCode:
    with open_sync_channel(addr, tls) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service", GRPC_SERVICES)
def test_each_port_refuses_plaintext_and_certless_peers(
    stack: LocalStack, tls_certs: CertFiles, service: str
) -> None:
    addr = stack.addr(service)
    assert health_code(addr, None) == grpc.StatusCode.UNAVAILABLE
    assert health_code(addr, TlsSettings(ca=str(tls_certs.ca))) == grpc.StatusCode.UNAVAILABLE
    assert healthcheck.main(["--addr", addr, *mtls_settings(tls_certs).to_args()]) == 0
