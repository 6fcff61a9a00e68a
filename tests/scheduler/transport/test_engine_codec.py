"""The engine boundary as Protobuf: every command, answer, row and count comes back from
its frame as it went in (rows and counts from a real engine step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import AlreadyExistsError, InvalidArgumentError, TokenlineError
from services.scheduler.core.messages import (
    AbortCommand,
    AbortOwnedCommand,
    AbortStartedCommand,
    AddCommand,
    CloseSessionCommand,
    EngineLimits,
    EngineOutput,
    EngineStats,
    FlushCommand,
    FlushOutcome,
    OpenSessionCommand,
)
from services.scheduler.core.req import DecodeFlags, Req, ReqTimes, SessionParams
from services.scheduler.sampling.prompt_logprobs import PromptLogprobState
from services.scheduler.transport.engine_codec import (
    decode_command,
    decode_output,
    decode_ready,
    encode_command,
    encode_output,
    encode_ready,
)
from services.scheduler.transport.proto_codec import row_from_pb, row_to_pb
from tests.scheduler.factories import make_req, make_scheduler

PROMPT = [0, *range(1000, 1030)]


def _full_req() -> Req:
    # Floats a float32 holds exactly: SamplingParams travels as float, as on every hop.
    req = make_req(
        "r-1",
        PROMPT,
        temperature=0.75,
        top_p=0.5,
        max_new_tokens=5,
        stop=["zz"],
        seed=3,
        no_stop_trim=True,
    )
    req.flags = DecodeFlags(reply_to="frontend-a", no_stop_trim=True, stop=("zz",))
    req.times = ReqTimes(received=1.0, templated=2.0, tokenized=3.0, dispatched=4.0, queued=5.0)
    req.priority = -2
    req.return_logprob = True
    req.top_logprobs_num = 3
    req.label = "client-id"
    req.session = SessionParams("s", rid="parent", offset=4, replace=True)
    req.stream = False
    req.prompt_logprobs = PromptLogprobState.create(PROMPT, 2, 4)
    return req


def test_an_add_command_carries_the_whole_request() -> None:
    sent = _full_req()
    command = decode_command(encode_command(AddCommand(sent, ticket=7)))
    assert isinstance(command, AddCommand) and command.ticket == 7
    got = command.req
    assert (got.rid, got.input_ids, got.params) == (sent.rid, sent.input_ids, sent.params)
    assert got.flags == DecodeFlags(
        reply_to="frontend-a", no_stop_trim=True, stop=("zz",)
    )  # rebuilt from the params, as for a request from the frontend
    assert got.times == ReqTimes(1.0, 2.0, 3.0, 4.0, queued=5.0)  # the acceptance stamp too
    assert (got.priority, got.return_logprob, got.top_logprobs_num) == (-2, True, 3)
    assert (got.label, got.session, got.stream) == ("client-id", sent.session, False)
    assert got.prompt_logprobs is not None
    assert (got.prompt_logprobs.start, got.prompt_logprobs.num_top) == (2, 4)


@pytest.mark.parametrize(
    "command",
    [
        AbortCommand("r", "client left"),
        AbortStartedCommand("detokenizer stream lost"),
        AbortOwnedCommand("frontend-a", "lease ended"),
        FlushCommand(ticket=3),
        OpenSessionCommand("s", 128, "frontend-a", ticket=4),
        CloseSessionCommand("s", ticket=5),
        None,  # stop
    ],
)
def test_every_other_command_comes_back_equal(command: object) -> None:
    assert decode_command(encode_command(command)) == command  # type: ignore[arg-type]


def test_ready_carries_the_limits_and_dtype() -> None:
    limits = EngineLimits(129280, 4096, 262144, 4096)
    assert decode_ready(encode_ready(limits, "bfloat16")) == (limits, "bfloat16")


def test_a_step_output_comes_back_equal(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir)
    req = make_req("a", PROMPT, temperature=0.0, max_new_tokens=3)
    req.return_logprob, req.top_logprobs_num = True, 2
    req.prompt_logprobs = PromptLogprobState.create(PROMPT, 0, 2)
    req.times.queued = 100.0
    scheduler.add_request(req)
    rows = []
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
        ),
        rows=tuple(map(row_to_pb, rows)),
        stats=stats,
    )
    got = decode_output(encode_output(output))
    assert got.rows == output.rows
    assert [row_from_pb(r) for r in got.rows] == rows  # every field survives the wire
    assert got.stats == output.stats
    assert (got.engine_stats, got.idle, got.num_applied) == (output.engine_stats, True, 2)
    assert got.answers[:2] == output.answers[:2]
    for (ticket, error), (sent_ticket, sent) in zip(
        got.answers[2:], output.answers[2:], strict=True
    ):
        assert ticket == sent_ticket and type(error) is type(sent)
        assert isinstance(error, TokenlineError) and isinstance(sent, TokenlineError)
        assert (error.message, error.field) == (sent.message, sent.field)
