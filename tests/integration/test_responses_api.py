"""``/v1/responses`` through the openai SDK against the shared live stack, and the
ResponsesCreate RPCs through a gRPC client on the frontend port.

The tiny random model's text is never asserted: structure, event order, usage, and that a
stream's deltas add up to the unary text of the same seed (the shared scheduler is
batch-invariant, so requests sent together decode as they would alone).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenline.v1 import frontend_pb2_grpc, responses_pb2

from services.common.errors import field_of
from services.common.tls import open_sync_channel
from services.launch import LocalStack
from tests.integration.forced_calls import BUDGET, SCHEMAS, TOOLS
from tests.live_stack import finish_counts, wait_for_finishes
from tests.waiting import wait_until

# Responses tools are flat: no nested "function".
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "role": {"enum": ["admin", "user", "guest"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["role", "age"],
    "additionalProperties": False,
}
EVENT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _create(client: openai.OpenAI, model_id: str, seed: int, **kwargs: Any) -> Any:
    kwargs.setdefault("input", f"Say something, {seed}.")
    kwargs.setdefault("max_output_tokens", 12)
    kwargs.setdefault("temperature", 0.8)
    extra = {"seed": seed, **kwargs.pop("extra_body", {})}
    return client.responses.create(model=model_id, extra_body=extra, **kwargs)


def _unary_and_stream(client: openai.OpenAI, model_id: str, **kwargs: Any) -> list[Any]:
    """Per seed 0..2: the unary response, then the stream's events, all sent at once."""

    def one(seed: int, stream: bool) -> Any:
        if stream:
            return list(_create(client, model_id, seed, stream=True, **kwargs))
        return _create(client, model_id, seed, **kwargs)

    asks = [(seed, stream) for seed in range(3) for stream in (False, True)]
    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(lambda a: one(*a), asks))


def test_unary_and_stream_agree(client: openai.OpenAI, model_id: str) -> None:
    replies = _unary_and_stream(client, model_id, instructions="Be brief.", max_output_tokens=40)
    for unary, events in zip(replies[::2], replies[1::2], strict=True):
        assert unary.object == "response" and unary.id.startswith("resp_")
        assert unary.status in ("completed", "incomplete") and unary.model == model_id
        assert [item.type for item in unary.output] == ["message"]
        assert unary.usage.input_tokens > 0 and 0 < unary.usage.output_tokens <= 40
        assert unary.usage.total_tokens == unary.usage.input_tokens + unary.usage.output_tokens
        assert unary.usage.input_tokens_details.cached_tokens >= 0

        types = [e.type for e in events]
        assert types[:4] == EVENT_ORDER and types[-4:-1] == TEXT_END
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert set(types[4:-4]) <= {"response.output_text.delta"}
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        last = events[-1].response
        assert deltas == unary.output_text == last.output_text
        assert types[-1] == f"response.{unary.status}" and last.status == unary.status
        assert last.usage.output_tokens == unary.usage.output_tokens
        assert last.usage.input_tokens == unary.usage.input_tokens


def test_a_small_budget_is_incomplete(client: openai.OpenAI, model_id: str) -> None:
    unary = _create(client, model_id, 0, max_output_tokens=2)
    assert unary.status == "incomplete"
    assert unary.incomplete_details.reason == "max_output_tokens"
    assert unary.usage.output_tokens == 2 and unary.output[0].status == "incomplete"
    events = list(_create(client, model_id, 0, max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_a_forced_function_gives_a_valid_function_call(
    client: openai.OpenAI, model_id: str
) -> None:
    choice = {"type": "function", "name": "get_weather"}
    replies = _unary_and_stream(
        client, model_id, tools=FLAT_TOOLS, tool_choice=choice, max_output_tokens=BUDGET
    )
    for unary, events in zip(replies[::2], replies[1::2], strict=True):
        assert unary.status == "completed"
        [call] = unary.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [e.arguments for e in done] == [call.arguments]
        deltas = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        assert deltas == call.arguments
        assert events[-1].response.output[0].arguments == call.arguments


def test_json_schema_output_parses_and_validates(client: openai.OpenAI, model_id: str) -> None:
    fmt = {"type": "json_schema", "name": "who", "schema": SMALL_SCHEMA, "strict": True}

    def one(seed: int) -> Any:
        return _create(client, model_id, seed, text={"format": fmt}, max_output_tokens=BUDGET)

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(one, range(3)))
    for reply in replies:
        assert reply.status == "completed" and reply.text.format.type == "json_schema"
        jsonschema.validate(json.loads(reply.output_text), SMALL_SCHEMA)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [{**FLAT_TOOLS[0], "strict": True}]}, "tools[0].strict"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}}, None),
        ({"extra_body": {"truncation": "auto"}}, "truncation"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    client: openai.OpenAI, model_id: str, kwargs: dict[str, Any], param: str | None
) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            _create(client, model_id, 0, stream=stream, **kwargs)
        body: Any = info.value.body
        if param is None:
            assert body["param"].startswith("text.format")
        else:
            assert body["param"] == param, body
        assert "Traceback" not in body["message"]


@pytest.fixture(scope="module")
def frontend(stack: LocalStack) -> Any:
    with open_sync_channel(stack.addr("frontend"), stack.tls) as channel:
        yield frontend_pb2_grpc.FrontendServiceStub(channel)


def test_grpc_client_gets_responses(frontend: Any) -> None:
    request = responses_pb2.ResponsesRequest(
        input_text="Hello", instructions="Be brief.", max_output_tokens=5, seed=1
    )
    unary = frontend.ResponsesCreate(request, timeout=60)
    assert unary.id.startswith("resp_") and unary.output[0].type == "message"
    assert unary.usage.output_tokens <= 5
    events = list(frontend.ResponsesCreateStream(request, timeout=60))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].response.status == unary.status
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == unary.output[0].content[0].text


def test_grpc_refuses_a_bad_field_by_name(frontend: Any) -> None:
    request = responses_pb2.ResponsesRequest(input_text="x", max_output_tokens=-3)
    with pytest.raises(grpc.RpcError) as info:
        frontend.ResponsesCreate(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(info.value) == "max_output_tokens"  # type: ignore[arg-type]


def _stored_count(stack: LocalStack) -> float:
    text = httpx.get(stack.ports.metrics_url("frontend"), timeout=10).text
    families = text_string_to_metric_families(text)
    found = [f for f in families if f.name == "tokenline_frontend_stored_responses"]
    return float(found[0].samples[0].value)


def test_a_stored_response_is_retrieved_and_continued(
    client: openai.OpenAI, model_id: str, stack: LocalStack
) -> None:
    before = _stored_count(stack)
    first = _create(client, model_id, 0, instructions="Be brief.")
    assert first.store is True
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    assert got.usage.output_tokens == first.usage.output_tokens
    second = _create(client, model_id, 1, input="And then?", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # The continuation's prompt holds the first turn's input and output.
    assert second.usage.input_tokens > first.usage.input_tokens
    events = list(
        _create(client, model_id, 1, input="And then?", previous_response_id=first.id, stream=True)
    )
    assert events[-1].response.output_text == second.output_text
    assert client.responses.retrieve(events[-1].response.id).id == events[-1].response.id
    assert _stored_count(stack) >= min(before + 3, 1024)  # the three, or a full store


def test_an_unknown_or_unstored_id_is_a_404_naming_it(client: openai.OpenAI, model_id: str) -> None:
    kept = _create(client, model_id, 0, store=False)
    assert kept.store is False
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(kept.id)
    assert kept.id in info.value.body["message"]  # type: ignore[index]
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as info:
            _create(client, model_id, 0, previous_response_id="resp_nope", stream=stream)
        body: Any = info.value.body
        assert body["param"] == "previous_response_id" and "resp_nope" in body["message"]


def test_a_continuation_reuses_the_previous_turns_kv(client: openai.OpenAI, model_id: str) -> None:
    """Without instructions the first turn's prompt starts the continuation's, so the
    prefix cache serves it."""
    first = _create(client, model_id, 2, input="A long first question about the weather. " * 8)
    second = _create(client, model_id, 3, input="And then?", previous_response_id=first.id)
    cached = second.usage.input_tokens_details.cached_tokens
    assert 0 < cached <= second.usage.input_tokens
    assert cached >= first.usage.input_tokens // 2


def test_the_sdks_stream_helper_accumulates_the_same_response(
    client: openai.OpenAI, model_id: str
) -> None:
    """``responses.stream`` rebuilds the response from the events by their indexes, so it
    checks that every delta lands on the item and part it names. It wants
    ``response.completed``: a schema whose output ends within the budget gives one."""
    fmt = {"type": "json_schema", "name": "who", "schema": SMALL_SCHEMA}
    kwargs: dict[str, Any] = {"text": {"format": fmt}, "max_output_tokens": BUDGET}
    unary = _create(client, model_id, 4, store=False, **kwargs)
    with client.responses.stream(
        model=model_id,
        input="Say something, 4.",
        temperature=0.8,
        store=False,
        extra_body={"seed": 4},
        **kwargs,
    ) as stream:
        final = stream.get_final_response()
    assert unary.status == final.status == "completed"
    assert final.output_text == unary.output_text
    jsonschema.validate(json.loads(final.output_text), SMALL_SCHEMA)


def test_input_items_list_the_conversation_newest_first_and_page(
    client: openai.OpenAI, model_id: str
) -> None:
    """A continuation's input items are the first turn's input, its output and the new
    input; the SDK pages through them (limit 1) by ``after``."""
    first = _create(client, model_id, 5, input=[{"role": "user", "content": "Hi there."}])
    second = _create(client, model_id, 6, input="And then?", previous_response_id=first.id)
    newest_first = client.responses.input_items.list(second.id)
    assert newest_first.has_more is False and newest_first.first_id == newest_first.data[0].id
    items = list(reversed(newest_first.data))
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"), *[(o.type, getattr(o, "role", None)) for o in first.output],
        ("message", "user"),
    ]  # fmt: skip
    assert items[0].content[0].type == "input_text" and items[0].content[0].text == "Hi there."
    assert items[1].id == first.output[0].id and items[-1].content[0].text == "And then?"
    assert len({i.id for i in items}) == len(items)
    paged = [i.id for i in client.responses.input_items.list(second.id, limit=1, order="asc")]
    assert paged == [i.id for i in items]
    only_first = client.responses.input_items.list(first.id, order="asc")
    assert [i.id for i in only_first.data] == [items[0].id]


@pytest.mark.parametrize(
    ("query", "param"),
    [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
     ({"after": "msg_nope"}, "after")],
)  # fmt: skip
def test_bad_input_items_paging_is_a_400_naming_it(
    client: openai.OpenAI, model_id: str, query: dict[str, Any], param: str
) -> None:
    stored = _create(client, model_id, 0, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.input_items.list(stored.id, **query)
    assert info.value.body["param"] == param  # type: ignore[index]


def test_delete_forgets_a_response(client: openai.OpenAI, model_id: str) -> None:
    stored = _create(client, model_id, 0, max_output_tokens=2)
    assert client.responses.delete(stored.id) is None
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError) as info:
            call(stored.id)
        assert stored.id in info.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(stored.id)


def test_a_background_response_is_polled_to_the_same_answer(
    client: openai.OpenAI, model_id: str
) -> None:
    """``background``: answered in_progress, polled to the end; it is the streamed path,
    so the same seed gives the unary text. Only a running one can be cancelled."""
    kwargs: dict[str, Any] = {"max_output_tokens": 16, "store": True}
    with ThreadPoolExecutor(2) as pool:
        unary_f = pool.submit(_create, client, model_id, 7, **kwargs)
        started = _create(client, model_id, 7, background=True, **kwargs)
        unary = unary_f.result()
    assert started.background is True and started.status == "in_progress"
    wait_until(
        lambda: client.responses.retrieve(started.id).status != "in_progress",
        60, "the background response's end",
    )  # fmt: skip
    done = client.responses.retrieve(started.id)
    assert done.status == unary.status and done.output_text == unary.output_text
    assert done.usage.output_tokens == unary.usage.output_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(done.id)
    assert f"already {done.status}" in info.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(unary.id)
    body: Any = info.value.body
    assert "Cannot cancel a synchronous response." in body["message"]
    assert body["param"] == "response_id"


def test_cancel_aborts_a_running_background_response(
    client: openai.OpenAI, model_id: str, stack: LocalStack
) -> None:
    before = finish_counts(stack)
    started = _create(client, model_id, 8, background=True, max_output_tokens=4000)
    cancelled = client.responses.cancel(started.id)
    assert cancelled.id == started.id and cancelled.status == "cancelled"
    assert wait_for_finishes(stack, before, 1) == {"abort": 1}  # freed, not run to the end
    assert client.responses.retrieve(started.id).status == "cancelled"
    assert client.responses.cancel(started.id).status == "cancelled"  # again: the same


def test_a_deleted_background_response_is_aborted(
    client: openai.OpenAI, model_id: str, stack: LocalStack
) -> None:
    before = finish_counts(stack)
    started = _create(client, model_id, 9, background=True, max_output_tokens=4000)
    client.responses.delete(started.id)
    assert wait_for_finishes(stack, before, 1) == {"abort": 1}


def test_background_without_store_is_refused_naming_it(
    client: openai.OpenAI, model_id: str
) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            _create(client, model_id, 0, background=True, store=False, stream=stream)
        assert info.value.body["param"] == "store"  # type: ignore[index]
