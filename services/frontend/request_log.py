"""One log line per finished request: what it cost and where the time went.

Logged on ``tokenline.requests`` at INFO; with ``--log-json`` the fields are keys
of the JSON object, so they can be queried without parsing the message.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenline.v1 import detokenizer_pb2

from services.common.stages import stage_durations_ms
from services.frontend.serving.output import finish_name

logger = logging.getLogger("tokenline.requests")


def request_fields(row: detokenizer_pb2.StrRow, label: str = "") -> dict[str, Any]:
    """The final row of one choice, as the fields of its log line (``label``: the
    client's id for it)."""
    return {
        "rid": row.rid,
        "label": label,
        "finish_reason": finish_name(row.finish_reason),
        "prompt_tokens": row.usage.prompt_tokens,
        "completion_tokens": row.usage.completion_tokens,
        "cached_tokens": row.usage.cached_tokens,
        "stages_ms": stage_durations_ms(row.times),
    }


def log_finished(row: detokenizer_pb2.StrRow, label: str = "") -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    fields = request_fields(row, label)
    stages = " ".join(f"{stage}_ms={ms}" for stage, ms in fields["stages_ms"].items())
    counts = " ".join(f"{k}={v}" for k, v in fields.items() if k != "stages_ms")
    logger.info("request finished %s %s", counts, stages, extra=fields)
