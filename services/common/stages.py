"""A request's stage breakdown, from the StageTimes stamps each process adds.

Stamps from different processes are wall clocks; across hosts they may skew, so a
stage whose end precedes its start is left out rather than reported negative.
"""

from __future__ import annotations

from tokenline.v1 import common_pb2

# stage -> (start stamp, end stamp). The first seven tile a request's life in order;
# the last two span several of them.
STAGES: dict[str, tuple[str, str]] = {
    "template": ("received", "templated"),
    "tokenize": ("templated", "tokenized"),
    "dispatch": ("tokenized", "queued"),  # routing and the AddRequest hop
    "queue": ("queued", "scheduled"),
    "prefill": ("scheduled", "first_token"),
    "decode": ("first_token", "finished"),
    "detokenize": ("finished", "detokenized"),
    "time_to_first_token": ("received", "first_token"),
    "end_to_end": ("received", "detokenized"),
}


def stage_durations(times: common_pb2.StageTimes) -> dict[str, float]:
    """Seconds per stage the request has both stamps for."""
    out = {}
    for stage, (start, end) in STAGES.items():
        begin, done = getattr(times, start), getattr(times, end)
        if begin and done and done >= begin:
            out[stage] = done - begin
    return out


def stage_durations_ms(times: common_pb2.StageTimes) -> dict[str, float]:
    """``stage_durations`` in milliseconds, rounded to the microsecond, for people to read."""
    return {stage: round(seconds * 1000, 3) for stage, seconds in stage_durations(times).items()}
