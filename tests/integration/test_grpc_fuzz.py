"""Hypothesis against a live frontend's gRPC door: any request message, however odd
(huge strings, deep JSON in tool schemas, out-of-range numbers, unknown enum values,
bytes that are not valid protobuf or not valid UTF-8), ends in success or
INVALID_ARGUMENT: never UNKNOWN or INTERNAL, and no process dies.

Requests come from each message's own descriptor, so a field added to the protos is
fuzzed without a change here. Sessions and the operator's calls are left out: they
change shared state, not input handling. Token budgets the fuzzer draws within reason
are cut to a few tokens, and an absent budget is set to the same few (the server's
default budget is covered by every other live test), so a valid request costs
milliseconds, not a default-length generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory, struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenline.v1 import (
    embeddings_pb2,
    frontend_pb2,
    frontend_pb2_grpc,
    generate_pb2,
    openai_pb2,
    responses_pb2,
)

from services.launch import LocalStack

pytestmark = pytest.mark.live

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


def is_allowed(code: grpc.StatusCode, details: str) -> bool:
    """Success or INVALID_ARGUMENT; or the refusals of a valid request that are not about
    its shape: an unknown `model`, or a stored response that is not there (a drawn
    `response_id`), is NOT_FOUND, as OpenAI answers them (404)."""
    is_unknown = details.startswith(("model:", "response_id:"))
    return code in ALLOWED or (code == grpc.StatusCode.NOT_FOUND and is_unknown)


_INT_BOUNDS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_ENUM: (-(2**31), 2**31 - 1),  # unknown values included
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
HUGE = "x" * 300_000
# Token counts the fuzzer may draw; within these bounds they are cut to CHEAP.
_BUDGET_FIELDS = {"max_tokens", "max_completion_tokens", "max_new_tokens", "min_tokens", "n"}
CHEAP = 3
# Where each fuzzed request keeps its output budget: (the sampling message, the field).
_OUTPUT_BUDGETS = {
    "GenerateReqInput": ("sampling_params", "max_new_tokens"),
    "ChatCompletionRequest": ("sampling", "max_tokens"),
    "CompletionRequest": ("sampling", "max_tokens"),
    "ResponsesRequest": (None, "max_output_tokens"),
}


def _strings() -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=40), st.just(HUGE), st.sampled_from(["", "\x00", "🦜" * 50]))


def _json() -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=10))
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=25,
    )


def _deep_json(depth: int) -> dict[str, Any]:
    """A schema nested past protobuf's recursion limit (100)."""
    node: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}}
    return node


def _struct() -> st.SearchStrategy[struct_pb2.Struct]:
    def build(value: dict[str, Any]) -> struct_pb2.Struct:
        out = struct_pb2.Struct()
        out.update(value)
        return out

    top = st.dictionaries(st.text(max_size=8), _json(), max_size=4)
    return st.one_of(top, st.sampled_from([_deep_json(20), _deep_json(150)])).map(build)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_BOUNDS:
        low, high = _INT_BOUNDS[kind]
        edges = st.sampled_from([v for v in (low, high, -1, 0, 1) if low <= v <= high])
        return st.one_of(edges, st.integers(low, high))
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    return _strings()


@st.composite
def messages(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0) -> Message:
    """Any message of ``descriptor``'s type: each field set or not, nested ones to depth 3."""
    message = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        _fill(draw, message, field, depth)
    return message


def _fill(draw: st.DrawFn, message: Message, field: FieldDescriptor, depth: int) -> None:
    target = getattr(message, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key_field, value_field = field.message_type.fields
        if value_field.message_type is None:
            pairs = draw(st.dictionaries(_scalar(key_field), _scalar(value_field), max_size=3))
            target.update(pairs)
        return
    if field.message_type is not None:
        if depth >= 3:
            return
        strategy = _message_strategy(field.message_type, depth + 1)
        if field.is_repeated:
            for item in draw(st.lists(strategy, max_size=3)):
                target.add().CopyFrom(item)
        else:
            target.CopyFrom(draw(strategy))
        return
    if field.is_repeated:
        target.extend(draw(st.lists(_scalar(field), max_size=4)))
        return
    value = draw(_scalar(field))
    if field.name in _BUDGET_FIELDS and CHEAP < value <= 100_000:
        value = CHEAP
    setattr(message, field.name, value)


def _message_strategy(descriptor: Descriptor, depth: int) -> st.SearchStrategy[Message]:
    if descriptor.full_name == "google.protobuf.Struct":
        return _struct()
    if descriptor.full_name == "google.protobuf.Value":
        return _json().map(
            lambda v: struct_pb2.Value(string_value=str(v)) if v is None else _value(v)
        )
    return messages(descriptor, depth)


def _value(raw: Any) -> struct_pb2.Value:
    holder = struct_pb2.Struct()
    holder.update({"v": raw})
    return holder.fields["v"]


def _without_state(request: Message) -> Message:
    """No sessions or stored responses: they are shared state, refused as NOT_FOUND when
    unknown. An absent output budget becomes ``CHEAP``."""
    for name in ("session_params", "previous_response_id"):
        if request.DESCRIPTOR.fields_by_name.get(name) is not None:
            request.ClearField(name)
    holder_name, budget = _OUTPUT_BUDGETS.get(request.DESCRIPTOR.name, (None, ""))
    holder = getattr(request, holder_name) if holder_name else request
    if budget and not holder.HasField(budget):
        setattr(holder, budget, CHEAP)
    return request


@pytest.fixture(scope="module")
def channel(stack: LocalStack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(stack.addr("frontend")) as open_channel:
        yield open_channel


def _status(call: Any) -> tuple[grpc.StatusCode, str]:
    """How a call ended, and its details (a stream is read to its end)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, Message):
            for _ in result:
                pass
    except grpc.RpcError as exc:
        return exc.code(), exc.details()  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


RPCS: dict[str, Any] = {
    "ChatCompletion": openai_pb2.ChatCompletionRequest,
    "ChatCompletionStream": openai_pb2.ChatCompletionRequest,
    "Completion": openai_pb2.CompletionRequest,
    "CompletionStream": openai_pb2.CompletionRequest,
    "Generate": generate_pb2.GenerateReqInput,
    "GenerateStream": generate_pb2.GenerateReqInput,
    "Tokenize": frontend_pb2.TokenizeRequest,
    "Detokenize": frontend_pb2.DetokenizeRequest,
    "ResponsesCreate": responses_pb2.ResponsesRequest,
    "ResponsesCreateStream": responses_pb2.ResponsesRequest,
    "Embed": embeddings_pb2.EmbeddingRequest,
    # A drawn id is almost never stored: these check that paging and odd ids are refused
    # cleanly, and cost no generation.
    "ResponsesInputItems": responses_pb2.ResponsesInputItemsRequest,
    "ResponsesDelete": responses_pb2.ResponsesDeleteRequest,
    "ResponsesCancel": responses_pb2.ResponsesCancelRequest,
    "ResponsesGetStream": responses_pb2.ResponsesGetStreamRequest,
}
# 25 examples an RPC: about two minutes for the module on two shared cores.
_FUZZ = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure reproduces
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("rpc", RPCS)
def test_any_request_message_is_served_or_invalid(channel: grpc.Channel, rpc: str) -> None:
    stub = frontend_pb2_grpc.FrontendServiceStub(channel)
    method = getattr(stub, rpc)

    @_FUZZ
    @given(messages(RPCS[rpc].DESCRIPTOR))
    def check(request: Message) -> None:
        code, details = _status(lambda: method(_without_state(request), timeout=120))
        assert is_allowed(code, details), (rpc, code, details, str(request)[:300])

    check()


@pytest.mark.parametrize("rpc", ["ChatCompletion", "Completion", "Generate", "Tokenize"])
def test_bytes_that_are_not_the_message_are_invalid_argument(
    channel: grpc.Channel, rpc: str
) -> None:
    call = channel.unary_unary(f"/tokenline.v1.FrontendService/{rpc}")

    @_FUZZ
    @given(
        st.one_of(
            st.binary(max_size=200),
            # Field 1 or 2 (a string in each of these) holding invalid UTF-8.
            st.sampled_from([b"\x0a\x02\xff\xfe", b"\x12\x03a\xc3\x28", b"\x0a\x05\xed\xa0\x80ab"]),
        )
    )
    def check(raw: bytes) -> None:
        code, details = _status(lambda: call(raw, timeout=60))
        assert is_allowed(code, details), (rpc, code, details, raw[:80])

    check()


def test_abort_by_any_rid_is_served_or_invalid(channel: grpc.Channel) -> None:
    """Only ``rid``: ``abort_all`` would end other modules' requests on the shared stack."""
    stub = frontend_pb2_grpc.FrontendServiceStub(channel)

    @_FUZZ
    @given(_strings())
    def check(rid: str) -> None:
        code, details = _status(lambda: stub.Abort(frontend_pb2.AbortRequest(rid=rid), timeout=30))
        assert code in ALLOWED, (code, details)

    check()


def test_every_process_survived_and_still_serves(stack: LocalStack, channel: grpc.Channel) -> None:
    assert all(proc.poll() is None for proc in stack.procs.values())
    stub = frontend_pb2_grpc.FrontendServiceStub(channel)
    reply = stub.Tokenize(frontend_pb2.TokenizeRequest(prompt="still here"), timeout=30)
    assert reply.count > 0
