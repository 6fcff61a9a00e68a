"""The scheduler's per-request state machine: waiting -> running -> finished | aborted."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from services.common.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True)
class FinishInfo:
    """Why a request ended; ``matched`` is the stop string or token id that hit."""

    kind: str  # "stop" | "length" | "abort"
    matched: str | int | None = None
    message: str = ""


@dataclass(slots=True)
class DecodeFlags:
    """Everything the detokenizer needs, sent on the first row of a rid."""

    reply_to: str = ""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop: list[str] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    flags: DecodeFlags = field(default_factory=DecodeFlags)
    times: dict[str, float] = field(default_factory=dict)
    priority: int = 0
    return_logprob: bool = False
    top_logprobs_num: int = 0

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Pool slots holding this request's KV, one per computed token, in order.
    kv_slots: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish: FinishInfo | None = None
    sent_init: bool = False
    generator: torch.Generator | None = None
    # Tokens produced since the last output row (usually one).
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs: prompt + generated so far."""
        return self.input_ids + self.output_ids

    @property
    def num_computed(self) -> int:
        return len(self.kv_slots)

    @property
    def num_uncomputed(self) -> int:
        return len(self.input_ids) + len(self.output_ids) - len(self.kv_slots)

    @property
    def is_finished(self) -> bool:
        return self.status in (ReqStatus.FINISHED, ReqStatus.ABORTED)
