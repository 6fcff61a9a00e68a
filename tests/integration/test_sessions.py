"""SGLang's sessions end to end on the live stack, over plain HTTP (and gRPC once): a
continuation prefills only its new tokens, its input is assembled exactly as the client
would assemble it, offset / drop_previous_output / replace change what it holds, and
closing the session (or losing its frontend) gives the pinned KV back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from tokenline.v1 import common_pb2, frontend_pb2_grpc, generate_pb2, openai_pb2, session_pb2

from services.common.errors import field_of
from services.launch import LocalStack
from tests.live_stack import front_half
from tests.waiting import wait_until

# Its last test kills the frontend, so the module has one of its own.
stack = front_half("sessions-logs")

MAX_NEW = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{stack.host}:{stack.ports.gateway}", timeout=60) as c:
        yield c


def ids(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1000 for i in range(length)]


def open_session(http: httpx.Client, capacity: int = 4096) -> str:
    reply = http.post("/open_session", json={"capacity_of_str_len": capacity})
    assert reply.status_code == 200, reply.text
    session_id = reply.json()
    assert isinstance(session_id, str) and session_id  # a bare JSON string, as SGLang's
    return session_id


def generate(http: httpx.Client, session: dict[str, Any] | None, **body: Any) -> httpx.Response:
    body = {"sampling_params": GREEDY, **body}
    if session is not None:
        body["session_params"] = session
    return http.post("/generate", json=body)


def ok(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    out: dict[str, Any] = reply.json()
    assert out["meta_info"]["finish_reason"]["type"] == "length", out
    return out


def refused(reply: httpx.Response, param: str) -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def pinned(stack: LocalStack) -> int:
    """KV tokens neither free nor evictable: held by requests or pinned by sessions."""
    info = stack.scheduler_info()
    return info.num_total_kv_tokens - info.num_free_kv_tokens - info.num_evictable_kv_tokens


def test_a_second_turn_prefills_only_its_new_tokens(http: httpx.Client, stack: LocalStack) -> None:
    assert pinned(stack) == 0 and stack.scheduler_info().num_sessions == 0
    sid = open_session(http)
    prompt = [0, *ids(1, 11)]
    t1 = ok(generate(http, {"id": sid}, input_ids=prompt))
    assert t1["meta_info"]["prompt_tokens"] == len(prompt)
    turn1 = prompt + t1["output_ids"]
    # The whole of turn 1, its last token included. That token's K/V is computed as a
    # planned row of the engine's next step, after turn 1's reply went out: wait for it.
    wait_until(lambda: pinned(stack) == len(turn1), 30.0, "turn 1 pinned", 0.05)
    new_ids = ids(2, 5)
    # The continuation's leading BOS is dropped: it does not start the text.
    t2 = ok(generate(http, {"id": sid, "rid": t1["meta_info"]["id"]}, input_ids=[0, *new_ids]))
    assert t2["meta_info"]["cached_tokens"] == len(turn1)
    assert t2["meta_info"]["prompt_tokens"] == len(turn1) + len(new_ids)
    # The same input ids outside the session, greedy: the same output.
    ref = ok(generate(http, None, input_ids=turn1 + new_ids))
    assert ref["output_ids"] == t2["output_ids"]
    assert stack.scheduler_info().num_sessions == 1
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert pinned(stack) == 0 and stack.scheduler_info().num_sessions == 0
    closed = {"id": sid, "rid": t2["meta_info"]["id"]}
    message = refused(generate(http, closed, input_ids=new_ids), "session_params.id")
    assert sid in message
    refused(http.post("/close_session", json={"session_id": sid}), "session_id")


def test_offset_drop_and_replace_shape_the_input(http: httpx.Client, stack: LocalStack) -> None:
    sid = open_session(http)
    prompt, new = ids(2, 9), ids(3, 4)
    t1 = ok(generate(http, {"id": sid}, input_ids=prompt))
    rid1 = t1["meta_info"]["id"]
    dropped = ok(
        generate(http, {"id": sid, "rid": rid1, "drop_previous_output": True}, input_ids=new)
    )
    assert dropped["meta_info"]["prompt_tokens"] == len(prompt) + len(new)
    assert dropped["meta_info"]["cached_tokens"] == len(prompt)
    cut = ok(generate(http, {"id": sid, "rid": rid1, "offset": 5}, input_ids=new))
    assert cut["meta_info"]["prompt_tokens"] == 5 + len(new)
    replaced = ok(generate(http, {"id": sid, "rid": rid1, "replace": True}, input_ids=new))
    assert replaced["meta_info"]["prompt_tokens"] == len(prompt) + MAX_NEW + len(new)
    # replace dropped t1's earlier continuations: they are no parents any more.
    gone = {"id": sid, "rid": dropped["meta_info"]["id"]}
    assert "has no request" in refused(generate(http, gone, input_ids=new), "session_params.rid")
    refused(generate(http, {"id": sid, "rid": "nope"}, input_ids=new), "session_params.rid")
    refused(
        generate(http, {"id": sid, "rid": rid1, "offset": -1}, input_ids=new),
        "session_params.offset",
    )
    fresh = ok(generate(http, {"id": sid, "replace": True}, input_ids=new))
    assert fresh["meta_info"]["prompt_tokens"] == len(new)
    refused(generate(http, {"id": sid, "rid": rid1}, input_ids=new), "session_params.rid")
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert pinned(stack) == 0


def test_session_id_and_capacity_are_checked(http: httpx.Client, stack: LocalStack) -> None:
    reply = http.post("/open_session", json={"capacity_of_str_len": 12, "session_id": "mine"})
    assert reply.json() == "mine"
    assert (
        http.post(
            "/open_session", json={"capacity_of_str_len": 12, "session_id": "mine"}
        ).status_code
        == 409
    )
    refused(http.post("/open_session", json={"capacity_of_str_len": 0}), "capacity_of_str_len")
    t1 = ok(generate(http, {"id": "mine"}, input_ids=ids(4, 3)))  # 3 + 8 = 11 tokens
    over = generate(http, {"id": "mine", "rid": t1["meta_info"]["id"]}, input_ids=ids(5, 2))
    assert "capacity_of_str_len" in refused(over, "session_params.id")
    assert http.post("/close_session", json={"session_id": "mine"}).status_code == 200


def test_the_grpc_path(stack: LocalStack) -> None:
    with grpc.insecure_channel(stack.addr("frontend")) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        sid = stub.OpenSession(session_pb2.OpenSessionReqInput(capacity_of_str_len=512)).session_id
        sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)

        def turn(parent: str) -> generate_pb2.GenerateOutput:
            request = generate_pb2.GenerateReqInput(
                input_ids=[openai_pb2.TokenIds(ids=ids(6, 5))],
                sampling_params=sampling,
                session_params=session_pb2.SessionParams(id=sid, rid=parent),
            )
            return stub.Generate(request, timeout=60).outputs[0]

        first = turn("")
        second = turn(first.rid)
        assert second.meta_info.cached_tokens == 5 + 4
        stub.CloseSession(session_pb2.CloseSessionReqInput(session_id=sid))
        with pytest.raises(grpc.RpcError) as err:
            turn(second.rid)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_of(err.value) == "session_params.id"


def test_a_session_lives_no_longer_than_its_frontend(http: httpx.Client, stack: LocalStack) -> None:
    """Last in the module: it kills the module's own frontend (``front_half``)."""
    sid = open_session(http)
    ok(generate(http, {"id": sid}, input_ids=ids(7, 6)))
    assert pinned(stack) > 0 and stack.scheduler_info().num_sessions == 1
    stack.kill("frontend")
    # The lease ends with the frontend's connection (the bound only ends a failure).
    wait_until(lambda: stack.scheduler_info().num_sessions == 0, 30.0, "no session", 0.05)
    assert pinned(stack) == 0
