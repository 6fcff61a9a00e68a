"""What the engine sends back across its boundary (``EngineOutput``, with its gauges,
rows, counts and answers) and the limits the RPC side validates against; the commands
that go in are in ``commands.py``.

Plain data and nothing live, so the same objects serve an engine on a thread
(``transport/engine_thread.py``) and one in its own process
(``transport/engine_process.py``, framed as Protobuf by ``transport/engine_codec.py``).
An answered command carries a ticket; the engine answers it in an output and the RPC
side (``transport/engine_client.py``) resolves the caller's future.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.common.errors import InvalidArgumentError
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import Req
from services.scheduler.core.stats import SchedulerStats

# What the engine serves (--runner, vLLM's name): "generate" runs every kind of request;
# "pooling" only pooling (embedding) requests, so no decode step ever runs.
Runner = Literal["generate", "pooling"]
RUNNERS: tuple[Runner, ...] = ("generate", "pooling")


@dataclass(frozen=True, slots=True)
class FlushOutcome:
    """What a flush found: it empties the prefix cache only when nothing is in flight."""

    flushed: bool
    num_running: int
    num_waiting: int
    reason: str = ""  # why not, when not flushed


# What a command's ``apply`` returned (None, a ``FlushOutcome``, ...), or the
# ``TokenlineError`` it raised.
Answer = object


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state (queues and KV) after its latest output; read from any thread.
    Gauges only: what the engine counts goes through ``SchedulerStats``."""

    num_waiting: int = 0
    num_running: int = 0
    num_free_kv_tokens: int = 0
    num_total_kv_tokens: int = 0
    num_cached_kv_tokens: int = 0  # in the prefix cache, shared or evictable
    num_evictable_kv_tokens: int = 0  # cached and held by no request
    num_sessions: int = 0


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """One message from the engine: after it applied commands, or after a step."""

    engine_stats: EngineStats
    idle: bool  # no request waits, runs or has a row still to send
    num_applied: int = 0  # commands applied since the previous output
    answers: tuple[tuple[int, Answer], ...] = ()  # (ticket, answer)
    # A step's rows, in order; the gRPC process makes the detokenizer's protobuf of them.
    rows: tuple[OutputRow, ...] = ()
    stats: SchedulerStats | None = None  # a step's counts


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What never changes once the engine is built: all the RPC side needs to refuse a
    request that could never run, without asking the engine."""

    vocab_size: int
    context_length: int  # already capped to the KV pool
    num_kv_tokens: int
    max_waiting_requests: int
    runner: Runner = "generate"
    hidden_size: int = 0  # the length of a pooled vector

    def validate(self, req: Req) -> None:
        """INVALID_ARGUMENT unless ``req`` could run here. The frontend validates too;
        this guards the engine from any other gRPC client."""
        self._validate_kind(req)
        if not req.input_ids:
            raise InvalidArgumentError("prompt has no tokens", field="prompt")
        if min(req.input_ids) < 0 or max(req.input_ids) >= self.vocab_size:
            raise InvalidArgumentError(
                f"token ids must be in [0, {self.vocab_size})", field="prompt"
            )
        self.check_fits(req)
        req.params.validate(self.vocab_size)
        if req.prompt_logprobs is not None:
            req.prompt_logprobs.validate(len(req.input_ids))

    def check_fits(self, req: Req) -> None:
        """INVALID_ARGUMENT unless the prompt fits the context. The one check the engine
        repeats on a request the RPC side validated: a session puts its parent's ids in
        front of the new ones, which only the engine knows."""
        # A pooling request keeps no output token, so its prompt may fill the context.
        num_tokens = len(req.input_ids) + (0 if req.pooling is not None else 1)
        if num_tokens > min(self.context_length, self.num_kv_tokens):
            raise InvalidArgumentError(
                f"prompt of {len(req.input_ids)} tokens does not fit the context",
                field="prompt",
            )

    def _validate_kind(self, req: Req) -> None:
        """A pooling request asks for nothing generated; a pooling runner takes nothing else."""
        if req.pooling is None:
            if self.runner == "pooling":
                raise InvalidArgumentError(
                    "this scheduler runs a pooling model (--runner pooling): only pooling "
                    "(embedding) requests are served",
                    field="pooling",
                )
            return
        if req.params.max_new_tokens != 0:
            raise InvalidArgumentError(
                "a pooling request generates nothing", field="max_new_tokens"
            )
        if req.session is not None:
            raise InvalidArgumentError("a pooling request has no session", field="session_params")
        if req.return_logprob or req.prompt_logprobs is not None:
            raise InvalidArgumentError("a pooling request has no logprobs", field="logprob")
