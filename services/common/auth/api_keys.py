"""API keys: who may call, in which role and within what limits.

Keys come from ``TOKENLINE_API_KEY`` (one admin key, fixed for the process's life) and
from a TOML key file holding several, reread when the file changes or on ``reload()``
(SIGHUP), so keys rotate without a restart. A key's secret is compared in constant
time and never printed: logs and metrics name a key by its ``name``.

The file::

    [[key]]
    name = "alice"            # what logs and metrics show
    secret = "sk-..."         # what the client sends as `Authorization: Bearer ...`
    role = "user"             # or "admin": abort_all, flush_cache, get_server_info
    max_concurrent = 8        # optional: requests in flight at once (0: no limit)
    tokens_per_minute = 50000 # optional: prompt + completion tokens (0: no limit)
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from services.common.envs import env_default

logger = logging.getLogger(__name__)

Role = Literal["user", "admin"]
ROLES: tuple[str, ...] = get_args(Role)
ENV_KEY_NAME = "env"
_BEARER = "bearer "
_FIELDS = frozenset({"name", "secret", "role", "max_concurrent", "tokens_per_minute"})


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key; ``secret`` is left out of repr so no log line can show it."""

    name: str
    role: Role
    secret: bytes = field(repr=False)
    max_concurrent: int = 0
    tokens_per_minute: int = 0

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def _limit(entry: dict[str, Any], name: str, what: str) -> int:
    value = entry.get(what, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"key {name!r}: {what} must be an integer >= 0")
    return value


def _parse_entry(entry: Any, index: int) -> ApiKey:
    if not isinstance(entry, dict):
        raise ValueError(f"key #{index}: expected a table")
    name, secret, role = entry.get("name"), entry.get("secret"), entry.get("role", "user")
    if not isinstance(name, str) or not name:
        raise ValueError(f"key #{index}: name must be a non-empty string")
    if not isinstance(secret, str) or len(secret) < 8:
        raise ValueError(f"key {name!r}: secret must be a string of 8 characters or more")
    if role not in ROLES:
        raise ValueError(f"key {name!r}: role must be one of {ROLES}")
    unknown = set(entry) - _FIELDS
    if unknown:
        raise ValueError(f"key {name!r}: unknown fields {sorted(unknown)}")
    return ApiKey(
        name=name,
        role=role,
        secret=secret.encode(),
        max_concurrent=_limit(entry, name, "max_concurrent"),
        tokens_per_minute=_limit(entry, name, "tokens_per_minute"),
    )


def parse_key_file(text: str) -> tuple[ApiKey, ...]:
    """The keys of a key file; ValueError naming the key (never its secret) when bad."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not TOML: {exc}") from None
    entries = data.get("key", [])
    if not isinstance(entries, list):
        raise ValueError("expected [[key]] tables")
    keys = tuple(_parse_entry(entry, i) for i, entry in enumerate(entries))
    names = [k.name for k in keys]
    if len(set(names)) != len(names) or ENV_KEY_NAME in names:
        raise ValueError(f"key names must be unique and not {ENV_KEY_NAME!r}")
    if len({k.secret for k in keys}) != len(keys):
        raise ValueError("two keys share a secret")
    return keys


def bearer_token(header: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` value ("" if it is none)."""
    if header[: len(_BEARER)].lower() != _BEARER:
        return ""
    return header[len(_BEARER) :].strip()


class KeyRing:
    """The keys this process accepts. ``env_key`` is fixed; the file's keys follow the
    file: each lookup notices a changed file (by its stat), ``reload`` rereads it anyway.
    A file that turns bad keeps the last good keys and logs why."""

    def __init__(self, env_key: str | None = None, path: str | None = None) -> None:
        self.path = path
        self._env = (ApiKey(ENV_KEY_NAME, "admin", env_key.encode()),) if env_key else ()
        self._file_keys: tuple[ApiKey, ...] = ()
        self._stamp: tuple[int, int, int] | None = None
        if path is not None:
            self._file_keys = self._read()  # a bad file at start is fatal (OSError, ValueError)

    @property
    def is_enabled(self) -> bool:
        """Keys are configured: every protected call needs one."""
        return bool(self._env) or self.path is not None

    @property
    def keys(self) -> tuple[ApiKey, ...]:
        if self.path is not None and self._file_stamp(self.path) != self._stamp:
            self.reload()
        return self._env + self._file_keys

    @staticmethod
    def _file_stamp(path: str) -> tuple[int, int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read(self) -> tuple[ApiKey, ...]:
        assert self.path is not None
        self._stamp = self._file_stamp(self.path)
        with open(self.path, encoding="utf-8") as f:
            keys = parse_key_file(f.read())
        logger.info("API keys loaded from %s: %s", self.path, ", ".join(k.name for k in keys))
        return keys

    def reload(self) -> None:
        """Reread the key file now (SIGHUP); a bad file keeps the keys in force."""
        if self.path is None:
            return
        try:
            self._file_keys = self._read()
        except (OSError, ValueError) as exc:
            logger.error("API key file %s not reloaded, old keys stay: %s", self.path, exc)

    def authenticate(self, token: str) -> ApiKey | None:
        """The key whose secret is ``token``; every secret is compared, in constant time."""
        given = token.encode()
        found = None
        for key in self.keys:
            if hmac.compare_digest(given, key.secret) and given:
                found = key
        return found

    def by_name(self, name: str) -> ApiKey | None:
        return next((k for k in self.keys if k.name == name), None)


def add_api_key_flags(parser: argparse.ArgumentParser) -> None:
    """``--api-key`` (one fixed admin key) and ``--api-key-file`` (several, rotatable)."""
    parser.add_argument(
        "--api-key",
        default=env_default("TOKENLINE_API_KEY", None),
        help="one admin key callers present as `Authorization: Bearer KEY` (the gateway also "
        "takes `x-api-key: KEY`), fixed for the process's life (env preferred: a flag shows "
        "in the process list)",
    )
    parser.add_argument(
        "--api-key-file",
        default=env_default("TOKENLINE_API_KEY_FILE", None),
        metavar="FILE",
        help="a TOML file of named keys with roles and limits (docs/security.md); "
        "reread when it changes or on SIGHUP",
    )


def create_key_ring(api_key: str | None, api_key_file: str | None) -> KeyRing:
    """The process's keys; a key file that cannot be read or parsed ends the start."""
    try:
        return KeyRing(api_key or None, api_key_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--api-key-file {api_key_file}: {exc}") from None
