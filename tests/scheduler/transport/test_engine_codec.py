"""The engine pipe's codec: every command, answer, row and count comes back from its frame
as it went in (rows and counts from a real engine step), nothing but our plain data can be
decoded, and a request crosses it validated once, on the RPC side."""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenline.v1 import common_pb2, scheduler_pb2

from services.common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    RateLimitedError,
    TokenlineError,
)
from services.common.sampling_params import SamplingParams
from services.scheduler.core.commands import (
    NO_TICKET,
    AbortCommand,
    AbortOwnedCommand,
    AbortStartedCommand,
    AddCommand,
    CloseSessionCommand,
    FlushCommand,
    OpenSessionCommand,
)
from services.scheduler.core.messages import EngineLimits, EngineOutput, EngineStats, FlushOutcome
from services.scheduler.core.output_row import OutputRow
from services.scheduler.core.req import DecodeFlags, Req, ReqTimes, SessionParams
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.sampling.prompt_logprobs import PromptLogprobState
from services.scheduler.transport.engine_client import EngineClient
from services.scheduler.transport.engine_codec import decode, encode
from services.scheduler.transport.engine_core import EngineCore
from services.scheduler.transport.proto_codec import req_from_pb
from tests.scheduler.factories import make_req, make_scheduler

PROMPT = [0, *range(1000, 1030)]


def _full_req() -> Req:
    req = make_req(
        "r-1",
        PROMPT,
        temperature=0.7,
        top_p=0.5,
        max_new_tokens=5,
        stop=["zz"],
        seed=3,
        no_stop_trim=True,
        logit_bias={5: 1.5},
    )
    req.flags = DecodeFlags(reply_to="frontend-a", no_stop_trim=True, stop=("zz",))
    req.times = ReqTimes(received=1.0, templated=2.0, tokenized=3.0, dispatched=4.0, queued=5.0)
    req.priority = -2
    req.return_logprob = True
    req.top_logprobs_num = 3
    req.label = "client-id"
    req.session = SessionParams("s", rid="parent", offset=4, replace=True)
    req.stream = False
    req.prompt_logprobs = PromptLogprobState.create(PROMPT, 0, 4)
    return req


def _fields(req: Req) -> dict[str, Any]:
    return {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}


def test_an_add_command_carries_the_whole_request() -> None:
    sent = _full_req()
    ticket, command = decode(encode((7, AddCommand(sent))))
    assert ticket == 7 and isinstance(command, AddCommand)
    assert command.req is not sent and _fields(command.req) == _fields(sent)


@pytest.mark.parametrize(
    "command",
    [
        AbortCommand("r", "client left"),
        AbortStartedCommand("detokenizer stream lost"),
        AbortOwnedCommand("frontend-a", "lease ended"),
        FlushCommand(),
        OpenSessionCommand("s", 128, "frontend-a"),
        CloseSessionCommand("s"),
    ],
)
def test_every_other_command_comes_back_equal(command: object) -> None:
    assert decode(encode((3, command))) == (3, command)
    assert decode(encode(None)) is None  # the stop


def test_the_ready_frame_carries_the_limits_and_dtype() -> None:
    limits = EngineLimits(129280, 4096, 262144, 4096, runner="pooling", hidden_size=256)
    assert decode(encode((limits, "bfloat16"))) == (limits, "bfloat16")


def test_a_step_output_comes_back_equal(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir)
    req = make_req("a", PROMPT, temperature=0.0, max_new_tokens=3)
    req.return_logprob, req.top_logprobs_num = True, 2
    req.prompt_logprobs = PromptLogprobState.create(PROMPT, 0, 2)
    req.times.queued = 100.0
    scheduler.add_request(req)
    rows: list[OutputRow] = []
    while scheduler.has_work:
        rows += scheduler.step()
    stats = scheduler.take_stats()
    assert rows[0].init is not None and rows[0].input_logprobs and rows[0].logprobs
    assert rows[-1].finish is not None and rows[-1].times is not None
    assert stats.finished and stats.step_tokens and stats.time_to_first_token_s
    output = EngineOutput(
        engine_stats=EngineStats(1, 2, 3, 4, 5, 6, 7),
        idle=True,
        num_applied=2,
        answers=(
            (1, None),
            (2, FlushOutcome(False, 1, 0, "1 running, 0 waiting")),
            (3, InvalidArgumentError("no open session 's'", field="session_id")),
            (4, AlreadyExistsError("session 's' is already open")),
            (5, RateLimitedError("slow down", retry_after_s=2.5)),  # an __init__ of its own
        ),
        rows=tuple(rows),
        stats=stats,
    )
    got = decode(encode(output))
    assert got.rows == output.rows  # every field of every row
    assert got.stats == output.stats
    assert (got.engine_stats, got.idle, got.num_applied) == (output.engine_stats, True, 2)
    assert got.answers[:2] == output.answers[:2]
    for (ticket, error), (sent_ticket, sent) in zip(
        got.answers[2:], output.answers[2:], strict=True
    ):
        assert ticket == sent_ticket and type(error) is type(sent)
        assert isinstance(error, TokenlineError) and isinstance(sent, TokenlineError)
        assert (error.message, error.field, str(error)) == (sent.message, sent.field, str(sent))
    assert got.answers[4][1].retry_after_s == 2.5


class _Shell:
    """Something of ours that is not plain data."""

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return (Scheduler, ())


class _Exploit:
    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return (os.system, ("true",))


@pytest.mark.parametrize(
    "frame",
    [pickle.dumps(_Exploit()), pickle.dumps(_Shell()), pickle.dumps(len), pickle.dumps(_Shell)],
    ids=["os.system", "a live class of ours", "a builtin", "a class outside services"],
)
def test_a_frame_that_names_anything_but_our_plain_data_is_refused(frame: bytes) -> None:
    with pytest.raises(pickle.UnpicklingError, match="may not cross the engine pipe"):
        decode(frame)


def _counting(calls: dict[str, int], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)

    return counted


def test_a_request_is_converted_and_validated_once_on_its_way_through_the_pipe(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the gRPC message to its final row, as with the engine process: the RPC side
    converts and validates it, the pipe carries the same ``Req``, and the engine takes
    it as validated."""
    calls = dict.fromkeys(["from_pb", "limits", "params", "prompt_logprobs"], 0)
    monkeypatch.setattr(
        SamplingParams,
        "from_pb",
        staticmethod(_counting(calls, "from_pb", SamplingParams.from_pb)),
    )
    monkeypatch.setattr(
        SamplingParams, "validate", _counting(calls, "params", SamplingParams.validate)
    )
    monkeypatch.setattr(EngineLimits, "validate", _counting(calls, "limits", EngineLimits.validate))
    monkeypatch.setattr(
        PromptLogprobState,
        "validate",
        _counting(calls, "prompt_logprobs", PromptLogprobState.validate),
    )
    scheduler = make_scheduler(default_model_dir)
    rows: list[OutputRow] = []
    client = EngineClient(scheduler.limits, sink=rows.extend)
    core = EngineCore(scheduler, emit=lambda output: client.handle(decode(encode(output))))
    pb = scheduler_pb2.TokenizedGenerateReqInput(
        rid="once",
        input_ids=PROMPT,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=3),
        reply_to="frontend-a",
    )
    pb.logprob.logprob_start_len = 1

    assert client.add_request(req_from_pb(pb)) is None
    ticket, command = decode(encode(client.inbox.get_nowait()))
    assert ticket == NO_TICKET and isinstance(command, AddCommand)
    core.apply(ticket, command)
    while scheduler.has_work:
        core.step()
    assert rows[-1].rid == "once" and rows[-1].finish is not None
    assert sum(len(row.new_token_ids) for row in rows) == 3
    assert calls == {"from_pb": 1, "limits": 1, "params": 1, "prompt_logprobs": 1}
    assert len(client.live) == 0
