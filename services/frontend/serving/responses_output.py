"""Chat output → Responses output: the response object and its output items.

A response is the chat completion of the same conversation (``responses_input.py``), said
in the Responses API's words: reasoning, message and function_call items; ``incomplete``
with reason ``max_output_tokens`` where the chat choice stopped on its budget.
"""

from __future__ import annotations

from tokenline.v1 import openai_pb2, responses_pb2

INCOMPLETE_REASON = {"length": "max_output_tokens", "abort": "aborted"}


def new_response(
    request: responses_pb2.ResponsesRequest, label: str, created: int, model: str
) -> responses_pb2.Response:
    """An ``in_progress`` response echoing the request's settings, as OpenAI's does."""
    out = responses_pb2.Response(
        id=f"resp_{label}",
        object="response",
        created_at=created,
        model=model,
        status="in_progress",
        instructions=request.instructions,
        tools=request.tools,
        parallel_tool_calls=(
            request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
        ),
        store=request.store if request.HasField("store") else True,  # OpenAI's default
        previous_response_id=request.previous_response_id,
        background=request.background,
    )
    for name in ("max_output_tokens", "temperature", "top_p"):
        if request.HasField(name):  # type: ignore[arg-type]
            setattr(out, name, getattr(request, name))
    if request.HasField("tool_choice"):
        out.tool_choice.CopyFrom(request.tool_choice)
    else:
        out.tool_choice.string_value = "auto"
    if request.HasField("text_format"):
        out.text_format.CopyFrom(request.text_format)
    else:
        out.text_format.type = "text"
    return out


def usage_of(usage: openai_pb2.CompletionUsage) -> responses_pb2.ResponseUsage:
    return responses_pb2.ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_tokens=usage.prompt_tokens_details.cached_tokens,
        reasoning_tokens=usage.completion_tokens_details.reasoning_tokens,
    )


def finish(response: responses_pb2.Response, finish_reason: str) -> None:
    """Set the final status from the chat choice's finish reason."""
    reason = INCOMPLETE_REASON.get(finish_reason)
    response.status = "completed" if reason is None else "incomplete"
    response.incomplete_reason = reason or ""


def message_item(label: str, text: str, status: str) -> responses_pb2.ResponseOutputItem:
    return responses_pb2.ResponseOutputItem(
        type="message",
        id=f"msg_{label}",
        status=status,
        role="assistant",
        content=[responses_pb2.ResponseOutputText(type="output_text", text=text)],
    )


def reasoning_item(label: str, text: str, status: str) -> responses_pb2.ResponseOutputItem:
    return responses_pb2.ResponseOutputItem(
        type="reasoning", id=f"rs_{label}", status=status, reasoning_text=text
    )


def call_item(
    label: str, index: int, call: openai_pb2.ToolCall, status: str
) -> responses_pb2.ResponseOutputItem:
    return responses_pb2.ResponseOutputItem(
        type="function_call",
        id=f"fc_{label}_{index}",
        status=status,
        call_id=call.id,
        name=call.function.name,
        arguments=call.function.arguments,
    )


def response_of(
    request: responses_pb2.ResponsesRequest, label: str, completion: openai_pb2.ChatCompletion
) -> responses_pb2.Response:
    """The whole response for a unary chat completion (one choice)."""
    out = new_response(request, label, completion.created, completion.model)
    choice = completion.choices[0]
    finish(out, choice.finish_reason)
    status = out.status
    message = choice.message
    if message.reasoning_content:
        out.output.append(reasoning_item(label, message.reasoning_content, "completed"))
    if message.content or not message.tool_calls:
        out.output.append(message_item(label, message.content, status))
    for i, call in enumerate(message.tool_calls):
        out.output.append(call_item(label, i, call, "completed"))
    out.usage.CopyFrom(usage_of(completion.usage))
    return out
