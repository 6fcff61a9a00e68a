"""TLS on a real grpc.aio server on loopback: TLS channels are served, plaintext and
unknown-CA channels are refused, and with mTLS so is a channel without a client cert."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import healthcheck
from services.common.rpc.server import GrpcProcess
from services.common.tls import (
    TlsSettings,
    add_tls_flags,
    open_channel,
    pop_tls_settings,
)
from tests.tls_certs import CertFiles, make_ca


def server_tls(certs: CertFiles, client_auth: str = "none") -> TlsSettings:
    return TlsSettings(
        cert=str(certs.server_cert),
        key=str(certs.server_key),
        ca=str(certs.ca),
        client_auth=client_auth,  # type: ignore[arg-type]
    )


def client_tls(certs: CertFiles, with_cert: bool) -> TlsSettings:
    if not with_cert:
        return TlsSettings(ca=str(certs.ca))
    return TlsSettings(
        ca=str(certs.ca), client_cert=str(certs.client_cert), client_key=str(certs.client_key)
    )


async def serving_process(tls: TlsSettings) -> GrpcProcess:
    process = GrpcProcess(host="127.0.0.1", port=0, service_names=[], tls=tls)
    await process.start()
    return process


@pytest.fixture
async def tls_server(tls_certs: CertFiles) -> AsyncIterator[GrpcProcess]:
    process = await serving_process(server_tls(tls_certs))
    yield process
    await process.server.stop(None)


@pytest.fixture
async def mtls_server(tls_certs: CertFiles) -> AsyncIterator[GrpcProcess]:
    process = await serving_process(server_tls(tls_certs, "require"))
    yield process
    await process.server.stop(None)


async def check(port: int, tls: TlsSettings | None) -> grpc.StatusCode:
    """Liveness over a channel made like the services make theirs; OK or the failure code."""
    async with open_channel(f"127.0.0.1:{port}", tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


async def test_tls_server_serves_a_tls_channel(tls_server: GrpcProcess, tls_certs) -> None:
    assert (
        await check(tls_server.port, client_tls(tls_certs, with_cert=False)) == grpc.StatusCode.OK
    )


async def test_tls_server_refuses_a_plaintext_channel(tls_server: GrpcProcess) -> None:
    assert await check(tls_server.port, None) == grpc.StatusCode.UNAVAILABLE


async def test_channel_refuses_a_server_from_another_ca(
    tls_server: GrpcProcess, tmp_path: Path
) -> None:
    make_ca(tmp_path, "some other CA")
    other = TlsSettings(ca=str(tmp_path / "ca.pem"))
    assert await check(tls_server.port, other) == grpc.StatusCode.UNAVAILABLE


async def test_server_name_override_verifies_against_the_given_name(
    tls_server: GrpcProcess, tls_certs: CertFiles
) -> None:
    ok = TlsSettings(ca=str(tls_certs.ca), server_name="localhost")
    wrong = TlsSettings(ca=str(tls_certs.ca), server_name="not-in-the-cert")
    assert await check(tls_server.port, ok) == grpc.StatusCode.OK
    assert await check(tls_server.port, wrong) == grpc.StatusCode.UNAVAILABLE


async def test_mtls_server_refuses_a_channel_without_a_client_cert(
    mtls_server: GrpcProcess, tls_certs: CertFiles
) -> None:
    no_cert = client_tls(tls_certs, with_cert=False)
    assert await check(mtls_server.port, no_cert) == grpc.StatusCode.UNAVAILABLE
    assert await check(mtls_server.port, None) == grpc.StatusCode.UNAVAILABLE


async def test_mtls_server_serves_a_channel_with_a_client_cert(
    mtls_server: GrpcProcess, tls_certs: CertFiles
) -> None:
    assert await check(mtls_server.port, client_tls(tls_certs, with_cert=True)) == (
        grpc.StatusCode.OK
    )
    # A service's own cert (server and client use) is its client identity by default.
    own = server_tls(tls_certs)
    assert await check(mtls_server.port, own) == grpc.StatusCode.OK


async def test_healthcheck_probe_speaks_mtls_from_its_flags(
    mtls_server: GrpcProcess, tls_certs: CertFiles
) -> None:
    addr = ["--addr", f"127.0.0.1:{mtls_server.port}", "--service", ""]
    cert = ["--tls-client-cert", str(tls_certs.client_cert)]
    cert += ["--tls-client-key", str(tls_certs.client_key)]
    with_ca = [*addr, "--tls-ca", str(tls_certs.ca)]
    # The probe is blocking: run it off the loop the server runs on.
    assert await asyncio.to_thread(healthcheck.main, [*with_ca, *cert]) == 0
    assert await asyncio.to_thread(healthcheck.main, with_ca) == 1
    assert await asyncio.to_thread(healthcheck.main, addr) == 1


def parse(argv: list[str]) -> TlsSettings:
    parser = argparse.ArgumentParser()
    add_tls_flags(parser)
    return pop_tls_settings(parser.parse_args(argv))


def test_no_tls_configured_means_plaintext() -> None:
    assert parse([]) == TlsSettings()
    assert not TlsSettings().is_enabled


def test_env_fills_in_and_flags_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLINE_TLS_CERT", "/env/cert.pem")
    monkeypatch.setenv("TOKENLINE_TLS_KEY", "/env/key.pem")
    monkeypatch.setenv("TOKENLINE_TLS_CA", "/env/ca.pem")
    monkeypatch.setenv("TOKENLINE_TLS_CLIENT_AUTH", "require")
    settings = parse(["--tls-ca", "/flag/ca.pem"])
    assert settings == TlsSettings(
        cert="/env/cert.pem", key="/env/key.pem", ca="/flag/ca.pem", client_auth="require"
    )
    assert settings.is_enabled
    assert parse(settings.to_args()) == settings


def test_bad_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLINE_TLS_CLIENT_AUTH", "sometimes")
    with pytest.raises(SystemExit, match="TOKENLINE_TLS_CLIENT_AUTH"):
        parse([])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--tls-cert", "c.pem"], "--tls-cert and --tls-key"),
        (["--tls-client-key", "k.pem"], "--tls-client-cert and --tls-client-key"),
        (["--tls-cert", "c", "--tls-key", "k", "--tls-client-auth", "require"], "--tls-ca"),
        (["--tls-server-name", "x"], "only with TLS on"),
    ],
)
def test_incomplete_settings_exit_naming_the_flags(argv: list[str], words: str) -> None:
    with pytest.raises(SystemExit, match=words):
        parse(argv)


async def test_a_server_without_a_cert_refuses_to_start_plaintext(tls_certs: CertFiles) -> None:
    with pytest.raises(SystemExit, match="--tls-cert"):
        GrpcProcess(
            host="127.0.0.1", port=0, service_names=[], tls=TlsSettings(ca=str(tls_certs.ca))
        )


async def test_unreadable_file_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(SystemExit, match="nope.pem"):
        GrpcProcess(
            host="127.0.0.1",
            port=0,
            service_names=[],
            tls=TlsSettings(cert=missing, key=missing),
        )
