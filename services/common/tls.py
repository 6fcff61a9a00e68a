"""TLS on every gRPC hop: one settings object, one set of flags, one channel factory.

With nothing configured every server port and channel stays plaintext, as on
loopback (`make run`, the tests). Any TLS setting turns TLS on for the whole
process: its gRPC port serves TLS (it then needs a certificate) and every channel
it opens verifies its server against ``ca`` (the system roots when unset). With
``client_auth="require"`` (mTLS) a server refuses peers without a certificate
signed by ``ca``; outgoing channels present the client certificate, or the
process's own certificate when no separate one is given.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import grpc

from services.common.envs import env_default

ClientAuth = Literal["none", "require"]
CLIENT_AUTH_CHOICES: tuple[str, ...] = get_args(ClientAuth)
ChannelOptions = Sequence[tuple[str, object]]

# A peer that is restarting, or still importing at start, refuses connections for a while.
# gRPC's default reconnect backoff (1 s, growing 1.6x toward 120 s) then keeps a channel
# failing for seconds after the peer is back; every stack start paid ~1 s of it. Retry from
# 100 ms and never wait more than 1 s: a refused connect costs the peer nothing. The connect
# timeout (grpc.min_reconnect_backoff_ms) keeps its 20 s for links across hosts.
RECONNECT_OPTIONS: ChannelOptions = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

# Flag name, settings field, and what the value is, in --help order.
_PATH_FLAGS = (
    (
        "--tls-cert",
        "cert",
        "certificate (chain) this process serves on its gRPC port and, by default, "
        "presents to servers that require a client certificate",
    ),
    ("--tls-key", "key", "private key of --tls-cert"),
    (
        "--tls-ca",
        "ca",
        "CA bundle that verifies the servers this process dials (default: the system "
        "roots) and, with --tls-client-auth require, its clients",
    ),
    (
        "--tls-client-cert",
        "client_cert",
        "certificate presented to servers that require one (default: --tls-cert)",
    ),
    ("--tls-client-key", "client_key", "private key of --tls-client-cert"),
)


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """Paths and policy, fixed at start; the default is plaintext everywhere."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    client_auth: ClientAuth = "none"
    client_cert: str | None = None
    client_key: str | None = None
    # Name to verify the server's certificate against instead of the dialled host.
    server_name: str | None = None

    def __post_init__(self) -> None:
        for cert, key, names in (
            (self.cert, self.key, "--tls-cert and --tls-key"),
            (self.client_cert, self.client_key, "--tls-client-cert and --tls-client-key"),
        ):
            if (cert is None) != (key is None):
                raise ValueError(f"{names} go together: give both or neither")
        if self.client_auth not in CLIENT_AUTH_CHOICES:
            raise ValueError(f"--tls-client-auth must be one of {CLIENT_AUTH_CHOICES}")
        if self.client_auth == "require" and (self.ca is None or self.cert is None):
            raise ValueError("--tls-client-auth require needs --tls-ca, --tls-cert and --tls-key")
        if self.server_name is not None and not self.is_enabled:
            raise ValueError("--tls-server-name applies only with TLS on (--tls-ca or a cert)")

    @property
    def is_enabled(self) -> bool:
        """Any certificate or CA given: this process's port and channels use TLS."""
        return any(p is not None for p in (self.cert, self.ca, self.client_cert))

    def to_args(self) -> list[str]:
        """The same settings as flags, for a child process (``tokenline launch``)."""
        args: list[str] = []
        for flag, name, _ in _PATH_FLAGS:
            if (value := getattr(self, name)) is not None:
                args += [flag, value]
        if self.client_auth != "none":
            args += ["--tls-client-auth", self.client_auth]
        if self.server_name is not None:
            args += ["--tls-server-name", self.server_name]
        return args


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """The ``--tls-*`` flags, each falling back to its ``TOKENLINE_TLS_*`` variable."""
    group = parser.add_argument_group("TLS between services (default: plaintext)")
    for flag, name, text in _PATH_FLAGS:
        env = f"TOKENLINE_TLS_{name.upper()}"
        group.add_argument(
            flag, dest=f"tls_{name}", default=env_default(env, None), metavar="PEM", help=text
        )
    group.add_argument(
        "--tls-client-auth",
        dest="tls_client_auth",
        choices=CLIENT_AUTH_CHOICES,
        default=env_default("TOKENLINE_TLS_CLIENT_AUTH", "none", _client_auth),
        help="require: mTLS, the gRPC port refuses clients without a certificate from --tls-ca",
    )
    group.add_argument(
        "--tls-server-name",
        dest="tls_server_name",
        default=env_default("TOKENLINE_TLS_SERVER_NAME", None),
        metavar="NAME",
        help="verify servers' certificates against this name instead of the dialled host",
    )


def _client_auth(raw: str) -> str:
    if raw not in CLIENT_AUTH_CHOICES:
        raise ValueError(f"expected one of {', '.join(CLIENT_AUTH_CHOICES)}")
    return raw


def pop_tls_settings(args: argparse.Namespace) -> TlsSettings:
    """Settings from parsed ``add_tls_flags`` flags; removes them from ``args`` so the
    rest maps onto a service's own config. A bad combination exits naming the flags."""
    values = {f.name: getattr(args, f"tls_{f.name}") for f in dataclasses.fields(TlsSettings)}
    for name in values:
        delattr(args, f"tls_{name}")
    try:
        return TlsSettings(**values)
    except ValueError as exc:
        raise SystemExit(f"TLS settings: {exc}") from exc


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SystemExit(f"cannot read {what} {path}: {exc.strerror}") from exc


def server_credentials(settings: TlsSettings) -> grpc.ServerCredentials:
    """TLS credentials for a gRPC port; with mTLS, clients must present a cert from ``ca``."""
    if settings.cert is None or settings.key is None:
        raise SystemExit("TLS is on but this server has no --tls-cert/--tls-key to serve")
    require = settings.client_auth == "require"
    return grpc.ssl_server_credentials(
        [(_read(settings.key, "--tls-key"), _read(settings.cert, "--tls-cert"))],
        root_certificates=_read(settings.ca, "--tls-ca") if require and settings.ca else None,
        require_client_auth=require,
    )


def channel_credentials(settings: TlsSettings) -> grpc.ChannelCredentials:
    """Verify the server against ``ca``; present a client certificate when there is one."""
    cert, key = settings.client_cert or settings.cert, settings.client_key or settings.key
    return grpc.ssl_channel_credentials(
        root_certificates=_read(settings.ca, "--tls-ca") if settings.ca else None,
        private_key=_read(key, "client key") if key else None,
        certificate_chain=_read(cert, "client certificate") if cert else None,
    )


def _secure_options(settings: TlsSettings, options: ChannelOptions) -> list[tuple[str, object]]:
    if settings.server_name is None:
        return list(options)
    return [*options, ("grpc.ssl_target_name_override", settings.server_name)]


def open_channel(
    addr: str,
    settings: TlsSettings | None,
    options: ChannelOptions = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``addr``: TLS when ``settings`` turn it on, else plaintext;
    ``interceptors`` see every call (the cluster token's, services/common/auth/cluster_token.py).
    It reconnects within a second of the peer coming back (``RECONNECT_OPTIONS``)."""
    chain = list(interceptors) or None
    options = [*RECONNECT_OPTIONS, *options]
    if settings is None or not settings.is_enabled:
        return grpc.aio.insecure_channel(addr, options=list(options), interceptors=chain)
    creds = channel_credentials(settings)
    secure = _secure_options(settings, options)
    return grpc.aio.secure_channel(addr, creds, options=secure, interceptors=chain)


def open_sync_channel(
    addr: str, settings: TlsSettings | None, options: ChannelOptions = ()
) -> grpc.Channel:
    """``open_channel`` for blocking callers (health probes, the local launcher)."""
    if settings is None or not settings.is_enabled:
        return grpc.insecure_channel(addr, options=list(options))
    creds = channel_credentials(settings)
    return grpc.secure_channel(addr, creds, options=_secure_options(settings, options))


def add_port(server: grpc.aio.Server, address: str, settings: TlsSettings | None) -> int:
    """Bind ``address`` with TLS when ``settings`` turn it on; returns the bound port."""
    if settings is None or not settings.is_enabled:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(settings))
