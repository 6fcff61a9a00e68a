"""Process-wide logging: plain text by default, one JSON object per line when asked.

JSON lines carry a record's ``extra=`` fields as keys, so a log pipeline can
filter on ``rid`` or ``finish_reason`` without parsing the message.
"""

from __future__ import annotations

import argparse
import logging

from pythonjsonlogger.json import JsonFormatter

from services.common.envs import env_default, parse_bool

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_JSON_FIELDS = {"asctime": "time", "levelname": "level", "name": "logger"}


def add_logging_args(p: argparse.ArgumentParser, default_level: str = "INFO") -> None:
    """``--log-level`` and ``--log-json``, the same in every service."""
    p.add_argument(
        "--log-level",
        default=env_default("TOKENLINE_LOG_LEVEL", default_level),
        help="logging level name (DEBUG, INFO, WARNING, ...)",
    )
    p.add_argument(
        "--log-json",
        action=argparse.BooleanOptionalAction,
        default=env_default("TOKENLINE_LOG_JSON", False, parse_bool),
        help="one JSON object per log line, with structured fields",
    )


def log_formatter(json_lines: bool) -> logging.Formatter:
    if json_lines:
        return JsonFormatter(
            " ".join(f"%({name})s" for name in _JSON_FIELDS) + " %(message)s",
            rename_fields=_JSON_FIELDS,
        )
    return logging.Formatter(_TEXT_FORMAT)


def setup_logging(level: str = "INFO", json_lines: bool = False) -> None:
    """Configure the root logger once, replacing any handler set before."""
    handler = logging.StreamHandler()
    handler.setFormatter(log_formatter(json_lines))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
