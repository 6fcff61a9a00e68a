"""Throwaway certificates for TLS tests: a CA, a server cert for loopback, a client cert.

Made with `cryptography` at test time (EC P-256, one day), so nothing secret is
committed and nothing expires in the tree.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class CertFiles:
    """PEM paths; the server cert also allows client use, as one identity per service."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


CA = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def make_ca(out: Path, name: str = "tokenline test CA") -> CA:
    """A self-signed CA written to ``out/ca.pem``."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(_name(name), _name(name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "ca.pem", cert, None)
    return cert, key


def _leaf(
    out: Path,
    stem: str,
    ca: CA,
    usages: list[x509.ObjectIdentifier],
    san: list[x509.GeneralName] | None = None,
) -> Path:
    key = ec.generate_private_key(ec.SECP256R1())
    ca_cert, ca_key = ca
    builder = _builder(_name(stem), ca_cert.subject, key.public_key()).add_extension(
        x509.ExtendedKeyUsage(usages), critical=False
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write(out / f"{stem}.pem", cert, key)
    return out / f"{stem}.pem"


def make_certs(out: Path) -> CertFiles:
    """CA, server (SAN localhost, 127.0.0.1; server and client use) and client certs."""
    ca = make_ca(out)
    server = _leaf(
        out,
        "server",
        ca,
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client = _leaf(out, "client", ca, [ExtendedKeyUsageOID.CLIENT_AUTH])
    return CertFiles(
        ca=out / "ca.pem",
        server_cert=server,
        server_key=server.with_suffix(".key"),
        client_cert=client,
        client_key=client.with_suffix(".key"),
    )
