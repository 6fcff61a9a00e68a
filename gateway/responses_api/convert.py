"""``/v1/responses`` JSON → the frontend's ResponsesRequest. JSON quirks end here (input as
a string or items, content as a string or parts, schemas as JSON text in the client's key
order); every rule about values is the frontend's."""

from __future__ import annotations

import json

from google.protobuf import json_format, struct_pb2
from tokenline.v1 import responses_pb2

from gateway.convert import content_into, schema_text
from gateway.errors import GatewayError
from gateway.responses_api.schemas import FunctionToolBody, InputItemBody, ResponsesBody


def _item(item: InputItemBody) -> responses_pb2.ResponsesInputItem:
    out = responses_pb2.ResponsesInputItem(
        type=item.type,
        role=item.role or "",
        call_id=item.call_id or "",
        name=item.name or "",
        arguments=item.arguments or "",
        output=item.output or "",
        id=item.id or "",
    )
    content_into(out, item.content)
    return out


def _tool(tool: FunctionToolBody) -> responses_pb2.ResponsesTool:
    out = responses_pb2.ResponsesTool(
        type=tool.type, name=tool.name, description=tool.description or ""
    )
    if tool.parameters is not None:
        out.parameters_json = json.dumps(tool.parameters, ensure_ascii=False)
    if tool.strict is not None:
        out.strict = tool.strict
    return out


def _tool_choice(value: str | dict[str, object]) -> struct_pb2.Value:
    try:
        return json_format.ParseDict(value, struct_pb2.Value())
    except json_format.ParseError as exc:
        raise GatewayError(400, f"tool_choice: {exc}", param="tool_choice") from None


def responses_request_to_proto(
    body: ResponsesBody, request_id: str
) -> responses_pb2.ResponsesRequest:
    """The frontend's request; ``request_id`` becomes the response id's suffix."""
    out = responses_pb2.ResponsesRequest(
        model=body.model,
        instructions=body.instructions or "",
        tools=[_tool(t) for t in body.tools or ()],
        user=body.user or "",
        request_id=request_id,
        previous_response_id=body.previous_response_id or "",
    )
    if isinstance(body.input, str):
        out.input_text = body.input
    else:
        out.input_items.items.extend(_item(i) for i in body.input)
    for name in (
        "max_output_tokens",
        "temperature",
        "top_p",
        "parallel_tool_calls",
        "seed",
        "store",
        "background",
    ):
        value = getattr(body, name)
        if value is not None:
            try:
                setattr(out, name, value)
            except (ValueError, TypeError) as exc:
                raise GatewayError(400, f"{name}: {exc}", param=name) from None
    if body.tool_choice is not None:
        out.tool_choice.CopyFrom(_tool_choice(body.tool_choice))
    if body.reasoning is not None and body.reasoning.effort is not None:
        out.reasoning_effort = body.reasoning.effort
    fmt = body.text.format if body.text is not None else None
    if fmt is not None:
        out.text_format.type, out.text_format.name = fmt.type, fmt.name
        out.text_format.description = fmt.description or ""
        if fmt.schema_ is not None:
            out.text_format.schema_json = schema_text(fmt.schema_)
        if fmt.strict is not None:
            out.text_format.strict = fmt.strict
    return out
