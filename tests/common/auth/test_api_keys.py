"""The key ring: parsing, constant-time lookup, rotation by file change or reload, and
secrets kept out of every message a log could show."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from services.common.auth.api_keys import KeyRing, bearer_token, parse_key_file

pytestmark = pytest.mark.unit

TWO_KEYS = """
[[key]]
name = "alice"
secret = "alice-secret"
[[key]]
name = "ops"
secret = "ops-secret-1"
role = "admin"
max_concurrent = 2
tokens_per_minute = 100
"""
KEY_A = '[[key]]\nname = "a"\nsecret = "long-enough"\n'


def _write(path: Path, text: str) -> None:
    staged = path.with_suffix(".tmp")
    staged.write_text(text)
    os.replace(staged, path)  # a new inode: the ring sees the change whatever the clock


def test_parse_keeps_roles_and_limits() -> None:
    alice, ops = parse_key_file(TWO_KEYS)
    assert (alice.name, alice.role, alice.max_concurrent) == ("alice", "user", 0)
    assert (ops.role, ops.max_concurrent, ops.tokens_per_minute) == ("admin", 2, 100)
    assert "secret" not in repr(ops)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[key]]\nname = "a"\nsecret = "short"', "8 characters"),
        ('[[key]]\nname = "a"\nsecret = "long-enough"\nrole = "root"', "role"),
        ('[[key]]\nname = "a"\nsecret = "long-enough"\nmax_concurrent = -1', "max_concurrent"),
        ('[[key]]\nname = "a"\nsecret = "long-enough"\nsecrte = "x"', "unknown fields"),
        (
            KEY_A + '[[key]]\nname = "a"\nsecret = "other-one"',
            "unique",
        ),
        (
            '[[key]]\nname = "a"\nsecret = "same-secret"\n'
            '[[key]]\nname = "b"\nsecret = "same-secret"',
            "share",
        ),
        ("key = [", "not TOML"),
    ],
)
def test_a_bad_file_is_refused_by_name_never_by_secret(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_key_file(text)
    assert "long-enough" not in str(info.value) and "same-secret" not in str(info.value)


def test_authenticate_finds_the_key_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    _write(path, TWO_KEYS)
    ring = KeyRing(env_key="env-secret", path=str(path))
    assert ring.authenticate("alice-secret").name == "alice"  # type: ignore[union-attr]
    assert ring.authenticate("env-secret").role == "admin"  # type: ignore[union-attr]
    for wrong in ("", "alice-secre", "alice-secret ", "ALICE-SECRET"):
        assert ring.authenticate(wrong) is None
    assert KeyRing().is_enabled is False and KeyRing().authenticate("") is None


def test_a_changed_file_rotates_keys_and_the_env_key_stays(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    _write(path, TWO_KEYS)
    ring = KeyRing(env_key="env-secret", path=str(path))
    _write(path, TWO_KEYS.replace("alice-secret", "alice-rotated"))
    assert ring.authenticate("alice-secret") is None
    assert ring.authenticate("alice-rotated").name == "alice"  # type: ignore[union-attr]
    assert ring.authenticate("env-secret") is not None


def test_a_bad_reload_keeps_the_keys_in_force_and_logs_no_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.toml"
    _write(path, TWO_KEYS)
    ring = KeyRing(path=str(path))
    _write(path, TWO_KEYS + "\n[[key]]\nname = 'bad'\nsecret = 'tiny'\n")
    with caplog.at_level(logging.INFO):
        assert ring.authenticate("ops-secret-1").name == "ops"  # type: ignore[union-attr]
        ring.reload()  # SIGHUP's path: same outcome
    assert "not reloaded" in caplog.text
    assert "secret-1" not in caplog.text and "alice-secret" not in caplog.text


def test_a_bad_file_at_start_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text("[[key]]\nname = 3\n")
    with pytest.raises(ValueError, match="name"):
        KeyRing(path=str(path))
    with pytest.raises(OSError):
        KeyRing(path=str(tmp_path / "missing.toml"))


@pytest.mark.parametrize(
    ("header", "token"),
    [("Bearer abc", "abc"), ("bearer abc ", "abc"), ("Basic abc", ""), ("", ""), ("Bearer", "")],
)
def test_bearer_token(header: str, token: str) -> None:
    assert bearer_token(header) == token
