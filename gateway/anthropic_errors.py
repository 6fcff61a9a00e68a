"""Anthropic's error shape, for the routes that speak Anthropic's API; ``gateway/errors.py``
picks it by path (the Messages API itself is ``gateway/anthropic/``).

``{"type": "error", "error": {"type", "message"}}``: the body has no ``param``, so the
message starts with the field in Anthropic's dotted spelling (``messages.0.role: ...``),
and a field the frontend names in chat terms is given its Messages name.
"""

from __future__ import annotations

import re
from typing import Any

ANTHROPIC_PATHS = frozenset({"/v1/messages"})

_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# Chat fields the frontend may name, as a Messages client spelled them.
_MESSAGES_NAME_OF = {
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}
_INDEX = re.compile(r"\[(\d+)\]")


def speaks_anthropic(path: str) -> bool:
    return path in ANTHROPIC_PATHS


def dotted(param: str) -> str:
    """``messages[0].content[1].type`` → ``messages.0.content.1.type``."""
    return _INDEX.sub(r".\1", _MESSAGES_NAME_OF.get(param, param))


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    if param:
        message = f"{dotted(param)}: {message.removeprefix(f'{param}: ')}"
    return {"type": "error", "error": {"type": error_type, "message": message}}
