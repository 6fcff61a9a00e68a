"""The scheduler's per-request state: the ``Req`` state machine (waiting -> running ->
finished | aborted) and the plain records it carries (``ReqTimes``, ``FinishInfo``,
``DecodeFlags``, ``SessionParams``). It composes the lower layers' per-request state
(penalties, grammar, prompt logprobs, cache node), which know it only through the narrow
protocols they declare. No protobuf here: ``transport.proto_codec`` converts at the edge."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from services.common.sampling_params import SamplingParams
from services.scheduler.mem_cache.radix_cache import TreeNode
from services.scheduler.model_executor.pooling import PoolingState
from services.scheduler.sampling.grammar import RequestGrammar
from services.scheduler.sampling.logits_processor import PenaltyState
from services.scheduler.sampling.prompt_logprobs import PromptLogprobState
from services.scheduler.sampling.sampler import LogprobEntry


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class FinishInfo:
    """Why a request ended; ``matched`` is the stop string or token id that hit."""

    kind: str  # "stop" | "length" | "abort"
    matched: str | int | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class DecodeFlags:
    """Everything the detokenizer needs, sent on the first row of a rid."""

    reply_to: str = ""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SessionParams:
    """Which session a request belongs to and which of its requests it continues."""

    id: str
    rid: str = ""  # the parent; "" starts a new root (or, with replace, a new tree)
    offset: int = 0  # keep the parent's first ``offset`` ids; 0 keeps them all
    replace: bool = False
    drop_previous_output: bool = False


@dataclass(slots=True)
class ReqTimes:
    """Wall-clock stamps (``time.time()``) of a request's stages; ``None`` until reached.
    The first four come from the client, the rest are the scheduler's own."""

    received: float | None = None  # frontend: the request arrived
    templated: float | None = None  # frontend: chat template rendered
    tokenized: float | None = None  # frontend: prompt ids final
    dispatched: float | None = None  # frontend: AddRequest sent
    queued: float | None = None  # accepted into the waiting queue
    scheduled: float | None = None  # first admitted into a forward batch
    first_token: float | None = None  # first token sampled
    finished: float | None = None  # last token sampled, or aborted


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    flags: DecodeFlags = field(default_factory=DecodeFlags)
    times: ReqTimes = field(default_factory=ReqTimes)
    priority: int = 0
    return_logprob: bool = False
    top_logprobs_num: int = 0
    label: str = ""  # the client's own id, for logs only: ``rid`` is the key
    # In a session: ``input_ids`` arrive as the new tokens only, and the session puts its
    # parent's in front when the request joins (sessions.py).
    session: SessionParams | None = None
    # A streamed request reports tokens as they come (every ``stream_interval``); a unary
    # one only needs its final row, so it sends nothing before it.
    stream: bool = True

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Pool slots holding this request's KV, one per computed token, in order. The first
    # ``num_tree_tokens`` belong to the radix cache (locked at ``cache_node``); the rest
    # are the request's own until it inserts them. While the request runs the list only
    # grows; anything else replaces it with a new list (the model runner's SlotMirror
    # copies only what a list it has seen gained).
    kv_slots: list[int] = field(default_factory=list)
    cache_node: TreeNode | None = None
    num_tree_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache at first admission.
    num_cached_tokens: int = 0
    num_retractions: int = 0
    # LongRoPE: the length whose factors rotate this request's keys, once it was recomputed
    # past the original context (``Scheduler._recompute_long``); 0 = its prompt's length.
    rope_len: int = 0
    arrival: int | None = None  # order among equal priorities; set when first queued
    finish: FinishInfo | None = None
    last_token_time: float | None = None  # wall clock of the newest sampled token
    sent_init: bool = False  # its first OutputRow (carrying the DecodeFlags) was made
    num_sent_ids: int = 0  # output ids already put in a row; the rest wait for the next
    # Tokens sampled by launched steps and not yet committed to ``output_ids`` (overlap
    # scheduling: overlap.py); always 0 without it.
    num_inflight: int = 0
    unsent_logprobs: list[LogprobEntry] = field(default_factory=list)
    generator: torch.Generator | None = None
    penalties: PenaltyState | None = None
    grammar: RequestGrammar | None = None  # set on arrival when the output must match one
    # Set when the request asked for prompt logprobs (``prompt_logprobs`` module).
    prompt_logprobs: PromptLogprobState | None = None
    # Set for a pooling (embedding) request: it samples nothing and ends once its prompt
    # is computed, its row carrying the pooled hidden state (``pooling`` module).
    pooling: PoolingState | None = None

    def token_slice(self, start: int, end: int) -> list[int]:
        """``(input_ids + output_ids)[start:end]`` without building the whole list."""
        num_prompt = len(self.input_ids)
        if end <= num_prompt:
            return self.input_ids[start:end]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        return self.input_ids[start:] + self.output_ids[: end - num_prompt]

    def max_prefix_len(self) -> int:
        """The most tokens whose KV may come from the prefix cache: all but the last (its
        logits give the next token), fewer while prompt logprobs still need logits or
        pooling still needs hidden states."""
        limit = len(self.input_ids) + len(self.output_ids) - 1
        num_prompt = len(self.input_ids)
        for state in (self.prompt_logprobs, self.pooling):
            needed = None if state is None else state.max_prefix_len(num_prompt)
            if needed is not None:
                limit = min(limit, needed)
        return limit

    @property
    def num_computed(self) -> int:
        return len(self.kv_slots)

    @property
    def num_uncomputed(self) -> int:
        """Tokens without KV, counting an in-flight one (its KV comes with the next step)."""
        return len(self.input_ids) + len(self.output_ids) + self.num_inflight - len(self.kv_slots)

    @property
    def is_finished(self) -> bool:
        return self.status in (ReqStatus.FINISHED, ReqStatus.ABORTED)
