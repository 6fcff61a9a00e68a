"""A response's input items (ResponsesInputItems): its request's input said as the items
OpenAI lists, each with an id, and one page of them.

A continuation's items start with the items of the conversation it continues (the
previous response's input items, then its output), so the list is the whole conversation
the response answered, as the template saw it, without the instructions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

from tokenline.v1 import responses_pb2

from services.common.errors import InvalidArgumentError

Item: TypeAlias = responses_pb2.ResponseOutputItem

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_items_of(request: responses_pb2.ResponsesRequest, label: str) -> list[Item]:
    """``request``'s input as listed items; an item without the client's ``id`` gets
    ``<prefix>_<label>_in<i>`` (unique within the response)."""
    kind = request.WhichOneof("input_kind")
    if kind == "input_text":
        item = _message("user", [("input_text", request.input_text)])
        item.id = f"msg_{label}_in0"
        return [item]
    if kind != "input_items":
        return []
    out = []
    for index, given in enumerate(request.input_items.items):
        item = _listed(given)
        item.id = given.id or f"{_ID_PREFIX[item.type]}_{label}_in{index}"
        out.append(item)
    return out


def _listed(given: responses_pb2.ResponsesInputItem) -> Item:
    """One input item as OpenAI lists it (its type already checked by chat_request_of)."""
    kind = given.type or "message"
    if kind == "function_call":
        return Item(
            type=kind,
            status="completed",
            call_id=given.call_id,
            name=given.name,
            arguments=given.arguments,
        )
    if kind == "function_call_output":
        return Item(type=kind, status="completed", call_id=given.call_id, output=given.output)
    part_type = "output_text" if given.role == "assistant" else "input_text"
    if given.WhichOneof("content_kind") == "parts":
        parts = [(part_type, part.text) for part in given.parts.parts]
    else:
        parts = [(part_type, given.content)]
    return _message(given.role, parts)


def _message(role: str, parts: Sequence[tuple[str, str]]) -> Item:
    item = Item(type="message", role=role, status="completed")
    for part_type, text in parts:
        item.content.add(type=part_type, text=text)
    return item


def paging_of(request: responses_pb2.ResponsesInputItemsRequest) -> tuple[int, str]:
    """(limit, order), defaults applied; a bad one is an INVALID_ARGUMENT naming it."""
    limit = request.limit if request.HasField("limit") else DEFAULT_LIMIT
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgumentError(f"must be between 1 and {MAX_LIMIT}, got {limit}", field="limit")
    order = request.order or "desc"
    if order not in ("asc", "desc"):
        raise InvalidArgumentError(f"{order!r} is not one of 'asc', 'desc'", field="order")
    return limit, order


def page_of(
    items: Sequence[Item], request: responses_pb2.ResponsesInputItemsRequest
) -> responses_pb2.ResponseItemList:
    """The page ``request`` asks for; a bad ``limit`` / ``order`` / ``after`` is an
    INVALID_ARGUMENT naming it."""
    limit, order = paging_of(request)
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if request.after:
        ids = [item.id for item in ordered]
        if request.after not in ids:
            raise InvalidArgumentError(
                f"no input item {request.after!r} in response {request.response_id!r}",
                field="after",
            )
        start = ids.index(request.after) + 1
    page = ordered[start : start + limit]
    return responses_pb2.ResponseItemList(
        object="list",
        data=page,
        first_id=page[0].id if page else "",
        last_id=page[-1].id if page else "",
        has_more=start + limit < len(ordered),
    )
