"""The engine pipe's codec: every command, answer, row and count comes back from its frame
as it went in (rows and counts from a real engine step), plain data keeps its kind,
nothing but the registered types of the boundary can be decoded (and every type the
boundary's messages hold is registered), and a request crosses it validated once, on
the RPC side."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenline.v1 import common_pb2, scheduler_pb2
from tokenline.v1.engine_pb2 import Ints, Record, Value

from services.common import errors as errors_module
from services.common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    RateLimitedError,
    TokenlineError,
)
from services.common.sampling_params import SamplingParams
from services.scheduler.core import commands as commands_module
from services.scheduler.core.commands import (
    NO_TICKET,
    AbortCommand,
    AbortOwnedCommand,
    AbortStartedCommand,
    AddCommand,
    CloseSessionCommand,
    EngineCommand,
    FlushCommand,
    OpenSessionCommand,
)
from services.scheduler.core.messages import EngineLimits, EngineOutput, EngineStats, FlushOutcome
from services.scheduler.core.output_row import OutputRow, RowInit
from services.scheduler.core.req import (
    DecodeFlags,
    FinishInfo,
    Req,
    ReqStatus,
    ReqTimes,
    SessionParams,
)
from services.scheduler.core.stats import FinishedReqStats, SchedulerStats
from services.scheduler.model_executor.pooling import PoolingState
from services.scheduler.sampling.prompt_logprobs import PromptLogprob, PromptLogprobState
from services.scheduler.transport.engine_client import EngineClient
from services.scheduler.transport.engine_codec import (
    BOUNDARY,
    ENGINE_ONLY,
    BoundaryTypes,
    CodecError,
    decode,
    encode,
)
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


def test_a_pooling_request_crosses_with_its_pooling_state() -> None:
    sent = make_req("e-1", PROMPT, max_new_tokens=0)
    sent.pooling = PoolingState("mean", normalize=False)
    _, command = decode(encode((NO_TICKET, AddCommand(sent))))
    assert _fields(command.req) == _fields(sent) and command.req.pooling is not sent.pooling


@pytest.mark.parametrize(
    "value",
    [
        [1, 2, 3],
        (1, 2, 3),
        [0.5, 1.5],
        (0.5, 1.5),
        [],
        (),
        [True, False],
        [1, True],  # Protobuf refuses a bool as an int: item by item
        [1.5, 2],  # not all floats: item by item, the 2 stays an int
        (7, 0.25, [(1, -0.5)]),
        {5: 1.5, "a": None},
        [2**63 - 1, -(2**63)],
        b"\x00\xff",
        "ok",
    ],
)
def test_plain_data_keeps_its_kind(value: object) -> None:
    got = decode(encode(value))
    assert got == value and type(got) is type(value)
    if isinstance(value, list | tuple):
        assert [type(item) for item in got] == [type(item) for item in value]


def test_token_ids_and_floats_travel_packed() -> None:
    frame = Value.FromString(encode((list(range(500)), (0.5,) * 64)))
    ids, floats = frame.tuple.values
    assert ids.WhichOneof("kind") == "int_list" and floats.WhichOneof("kind") == "float_tuple"


def _frame(type_name: str, *fields: Value) -> bytes:
    return Value(record=Record(type=type_name, fields=fields)).SerializeToString()


@pytest.mark.parametrize(
    "frame",
    [
        _frame("Scheduler"),
        _frame("system", Value(str_value="true")),
        _frame("TreeNode", Value(int_list=Ints(values=[1]))),  # engine state, never sent
        _frame("services.scheduler.core.commands.AbortCommand"),
        Value().SerializeToString(),
    ],
    ids=["a live class of ours", "a builtin", "engine-only state", "a dotted path", "empty"],
)
def test_a_frame_that_names_anything_but_our_plain_data_is_refused(frame: bytes) -> None:
    with pytest.raises(CodecError, match="engine pipe"):
        decode(frame)


@pytest.mark.parametrize(
    "message",
    [object(), len, torch.zeros(1), {1, 2}, [1, print]],
    ids=["an object", "a builtin", "a tensor", "a set", "nested"],
)
def test_encoding_anything_but_our_plain_data_is_refused(message: object) -> None:
    with pytest.raises(CodecError, match="may not cross the engine pipe"):
        encode(message)


def test_every_command_answer_error_and_nested_type_is_registered() -> None:
    """Walked from the type hints, so a command, an answer or a nested record added later
    is found without being listed anywhere."""
    registered = set(BOUNDARY.by_name.values())
    commands = {c for c in vars(commands_module).values() if _is_command(c)}
    errors = {e for e in vars(errors_module).values() if _is_error(e)}
    nested = {Req, SamplingParams, DecodeFlags, ReqTimes, SessionParams, ReqStatus}
    nested |= {PromptLogprobState, PromptLogprob, PoolingState, FinishInfo, RowInit}
    nested |= {OutputRow, EngineStats, SchedulerStats, FinishedReqStats, FlushOutcome}
    assert commands and errors
    assert commands | errors | nested | {EngineOutput, EngineLimits} <= registered
    assert not registered & ENGINE_ONLY


def _is_command(value: object) -> bool:
    return (
        isinstance(value, type) and issubclass(value, EngineCommand) and value is not EngineCommand
    )


def _is_error(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, TokenlineError)


def _classes_in(value: object, seen: set[type]) -> set[type]:
    """Every class of an object inside ``value`` other than builtin containers and scalars."""
    if isinstance(value, list | tuple):
        for item in value:
            _classes_in(item, seen)
    elif isinstance(value, dict):
        _classes_in(list(value.items()), seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        seen.add(type(value))
        _classes_in([getattr(value, f.name) for f in dataclasses.fields(value)], seen)
    elif not isinstance(value, str | bytes | int | float | type(None)):
        seen.add(type(value))
    return seen


def test_every_class_inside_real_messages_is_registered(default_model_dir: Path) -> None:
    """The type hints tell the truth: what a full request and a real step hold is what
    the walk registered (a field hinted ``object`` would slip past the walk, not this)."""
    scheduler = make_scheduler(default_model_dir)
    req = make_req("a", PROMPT, temperature=0.0, max_new_tokens=2)
    req.return_logprob, req.top_logprobs_num = True, 2
    req.prompt_logprobs = PromptLogprobState.create(PROMPT, 0, 2)
    messages: list[object] = [AddCommand(_full_req()), EngineLimits(1, 2, 3, 4)]
    scheduler.add_request(req)
    while scheduler.has_work:
        messages += [scheduler.step(), scheduler.take_stats()]
    found = _classes_in(messages, set())
    assert OutputRow in found and RowInit in found and FinishInfo in found
    assert found <= set(BOUNDARY.by_name.values())


def test_a_reachable_type_that_is_not_plain_data_fails_the_walk() -> None:
    @dataclasses.dataclass
    class Carrier:
        lock: threading.Lock

    with pytest.raises(TypeError, match="Carrier.lock.*cannot cross the engine pipe"):
        BoundaryTypes([Carrier])


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
