"""Who the current call is made for, and what that caller may do.

The frontend's authenticator sets the caller once per RPC (or per multiplexed stream);
code that decides by role or ownership reads it here instead of threading it through
every signature. ``None``: API keys are off and every caller may do everything.
"""

from __future__ import annotations

from contextvars import ContextVar

from services.common.auth.api_keys import ApiKey
from services.common.errors import PermissionDeniedError

_CALLER: ContextVar[ApiKey | None] = ContextVar("tokenline_caller", default=None)


def current_caller() -> ApiKey | None:
    return _CALLER.get()


def set_caller(key: ApiKey | None) -> None:
    """For the rest of this task (one RPC, or one multiplexed stream)."""
    _CALLER.set(key)


def caller_name() -> str:
    """The caller's key name ("" without keys): what owns a request, what metrics show."""
    key = _CALLER.get()
    return key.name if key is not None else ""


def is_admin() -> bool:
    key = _CALLER.get()
    return key is None or key.is_admin


def require_admin(what: str) -> None:
    """PERMISSION_DENIED unless the caller holds an admin key (or keys are off)."""
    if not is_admin():
        raise PermissionDeniedError(f"{what} needs an admin key")


def may_touch(owner: str) -> bool:
    """Whether the caller may act on a request made by the key named ``owner``."""
    return is_admin() or owner == caller_name()
