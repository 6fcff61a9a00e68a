"""A response's input items: the request's input as listed items, and one page of them."""

from __future__ import annotations

import pytest
from tokenline.v1 import openai_pb2, responses_pb2

from services.common.errors import InvalidArgumentError
from services.frontend.serving.responses_items import input_items_of, page_of

Item = responses_pb2.ResponsesInputItem


def _request(*items: Item) -> responses_pb2.ResponsesRequest:
    return responses_pb2.ResponsesRequest(
        input_items=responses_pb2.ResponsesInputItems(items=items)
    )


def test_string_input_is_one_user_message() -> None:
    [item] = input_items_of(responses_pb2.ResponsesRequest(input_text="hi"), "abc")
    assert (item.type, item.id, item.role, item.status) == (
        "message",
        "msg_abc_in0",
        "user",
        "completed",
    )
    assert [(p.type, p.text) for p in item.content] == [("input_text", "hi")]


def test_items_keep_the_clients_ids_and_say_each_type() -> None:
    parts = openai_pb2.ContentParts(parts=[openai_pb2.ContentPart(type="input_text", text="x")])
    listed = input_items_of(
        _request(
            Item(role="user", parts=parts),
            Item(type="message", role="assistant", content="earlier", id="msg_old"),
            Item(type="function_call", call_id="c1", name="f", arguments="{}", id="fc_old"),
            Item(type="function_call_output", call_id="c1", output="42"),
        ),
        "L",
    )
    assert [i.id for i in listed] == ["msg_L_in0", "msg_old", "fc_old", "fco_L_in3"]
    assert [(p.type, p.text) for p in listed[1].content] == [("output_text", "earlier")]
    assert (listed[2].call_id, listed[2].name, listed[2].arguments) == ("c1", "f", "{}")
    assert (listed[3].type, listed[3].call_id, listed[3].output) == (
        "function_call_output", "c1", "42",
    )  # fmt: skip


ITEMS = [responses_pb2.ResponseOutputItem(type="message", id=f"i{n}") for n in range(5)]


def _page(**fields: object) -> responses_pb2.ResponseItemList:
    request = responses_pb2.ResponsesInputItemsRequest(response_id="resp_x", **fields)  # type: ignore[arg-type]
    return page_of(ITEMS, request)


def test_newest_first_by_default_and_pages_follow_after() -> None:
    first = _page(limit=2)
    assert [i.id for i in first.data] == ["i4", "i3"] and first.object == "list"
    assert (first.first_id, first.last_id, first.has_more) == ("i4", "i3", True)
    rest = _page(limit=2, after=first.last_id)
    assert [i.id for i in rest.data] == ["i2", "i1"] and rest.has_more
    last = _page(limit=2, after="i1")
    assert [i.id for i in last.data] == ["i0"] and not last.has_more
    assert [i.id for i in _page(order="asc").data] == [f"i{n}" for n in range(5)]
    assert not _page().has_more  # 5 items, the default limit 20


def test_an_empty_page_after_the_last_item() -> None:
    page = _page(order="asc", after="i4")
    assert list(page.data) == [] and (page.first_id, page.last_id, page.has_more) == ("", "", False)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"limit": -5}, "limit"),
        ({"order": "newest"}, "order"),
        ({"after": "nope"}, "after"),
    ],
)
def test_bad_paging_names_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _page(**fields)
    assert info.value.field == field
