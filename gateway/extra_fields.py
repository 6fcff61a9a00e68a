"""No silent drops: a body field tokenline does not declare is accepted only when harmless.

Invariant 7 of the design: a field the client sent either takes effect or is refused by
name. The schemas (``gateway/schemas.py``) declare every field that takes effect; this
module decides about the rest, walking every nested object of the parsed body:

* ``METADATA`` fields describe the request, never what is generated: accepted and
  logged at debug.
* ``DEFAULT_ONLY`` fields are accepted while they hold the value that changes nothing
  (``best_of: 1``, ``use_beam_search: false``); any other value is refused.
* A field whose value is null asks for nothing: accepted.
* Everything else is a 400 naming the field, with the reason when it is a known
  feature tokenline does not implement (``UNSUPPORTED``).

Paths use the client's spelling, list items as ``[i]`` (``messages[0].refusal``); the
tables list them with ``[]`` for any item. ``/generate`` also takes proto JSON, so there a
key that is a proto field's JSON name (``samplingParams``) is declared, and what is inside
it is checked against the proto message instead.
"""

from __future__ import annotations

import functools
import logging
import re
import typing
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from pydantic import BaseModel
from tokenline.v1 import common_pb2, generate_pb2, openai_pb2, session_pb2

from gateway.errors import GatewayError
from gateway.schemas import (
    GenerateBody,
    GenerateSamplingBody,
    LogprobOptionsBody,
    SessionParamsBody,
    TokenIdsBody,
)

logger = logging.getLogger(__name__)

METADATA: frozenset[str] = frozenset(
    {
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "request_id",  # the X-Request-Id header is the label tokenline echoes
        "guided_decoding_backend",  # one backend here (xgrammar): the choice changes nothing
        "messages[].refusal",  # a previous assistant turn's fields the template never renders
        "messages[].annotations",
        "messages[].content[].cache_control",
    }
)

DEFAULT_ONLY: dict[str, Any] = {
    "best_of": 1,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "return_tokens_as_token_ids": False,
    "modalities": ["text"],
    "tools[].function.strict": False,
    # /v1/responses: nothing extra asked (the Agents SDK always sends the list).
    "include": [],
}

UNSUPPORTED: dict[str, str] = {
    "functions": "use tools",
    "function_call": "use tool_choice",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "verbosity": "not supported",
    "web_search_options": "not supported",
    "tools[].function.strict": "only tool_choice 'required' or a named function constrains "
    "calls by their schema",
    "structural_tag": "structural tags are not supported",
    "guided_whitespace_pattern": "not supported",
    "structured_outputs.whitespace_pattern": "not supported",
    "structured_outputs.disable_any_whitespace": "not supported",
    "structured_outputs.structural_tag": "structural tags are not supported",
    "bad_words": "not supported",
    "allowed_token_ids": "not supported",
    "cache_salt": "the prefix cache is shared",
    "chat_template": "the server's chat template is used",
    "stop_regex": "not supported",
    "custom_logit_processor": "not supported",
    "lora_path": "not supported",
    "image_data": "not supported",
}

_INDEX = re.compile(r"\[\d+\]")

# Bodies that are proto JSON too: the message each one is parsed into.
_PROTO_OF: dict[type[BaseModel], Descriptor] = {
    GenerateBody: generate_pb2.GenerateReqInput.DESCRIPTOR,
    GenerateSamplingBody: common_pb2.SamplingParams.DESCRIPTOR,
    LogprobOptionsBody: common_pb2.LogprobOptions.DESCRIPTOR,
    TokenIdsBody: openai_pb2.TokenIds.DESCRIPTOR,
    SessionParamsBody: session_pb2.SessionParams.DESCRIPTOR,
}


def check_extra_fields(body: BaseModel) -> None:
    """Raise a 400 for the first undeclared field that could change the output; log the
    harmless ones at debug."""
    for path, value in _extras(body, ""):
        pattern = _INDEX.sub("[]", path)
        if value is None or pattern in METADATA:
            logger.debug("ignored field %s", path)
        elif pattern in DEFAULT_ONLY and value == DEFAULT_ONLY[pattern]:
            logger.debug("ignored field %s (its default)", path)
        else:
            raise _refusal(path, pattern, value)


def _refusal(path: str, pattern: str, value: Any) -> GatewayError:
    if pattern in UNSUPPORTED:
        why = f"not supported by tokenline ({UNSUPPORTED[pattern]})"
    elif pattern in DEFAULT_ONLY:
        why = f"only {DEFAULT_ONLY[pattern]!r} is supported, got {value!r}"
    else:
        why = "unknown field; tokenline refuses what it cannot honour"
    return GatewayError(400, f"{path}: {why}", param=path, code="unsupported_field")


def _extras(model: BaseModel, prefix: str) -> list[tuple[str, Any]]:
    """(path, value) of every undeclared field in ``model`` and the models inside it."""
    descriptor = _PROTO_OF.get(type(model))
    found = []
    for key, value in (model.model_extra or {}).items():
        field = _proto_field(descriptor, key) if descriptor is not None else None
        if field is None:
            found.append((_join(prefix, key), value))
        else:
            found += _proto_extras(field, value, _join(prefix, key))
    for name, spelling in _fields_holding_models(type(model)):
        found += _nested(getattr(model, name), _join(prefix, spelling))
    return found


@functools.cache
def _fields_holding_models(cls: type[BaseModel]) -> tuple[tuple[str, str], ...]:
    """(attribute, client spelling) of each field of ``cls`` whose type can hold a model:
    the only ones worth walking (a prompt's token ids never are)."""
    return tuple(
        (name, info.alias or name)
        for name, info in cls.model_fields.items()
        if _can_hold_model(info.annotation)
    )


def _can_hold_model(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_can_hold_model(arg) for arg in typing.get_args(annotation))


def _nested(value: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(value, BaseModel):
        return _extras(value, path)
    found: list[tuple[str, Any]] = []
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, BaseModel | list):  # a path only where a model can be
                found += _nested(item, f"{path}[{i}]")
    return found


def _proto_field(descriptor: Descriptor, key: str) -> FieldDescriptor | None:
    return descriptor.fields_by_camelcase_name.get(key) or descriptor.fields_by_name.get(key)


def _proto_extras(field: FieldDescriptor, value: Any, path: str) -> list[tuple[str, Any]]:
    """Unknown keys inside a proto-JSON value of ``field`` (maps and well-known types hold
    any keys)."""
    message = field.message_type
    if message is None or message.GetOptions().map_entry:
        return []
    if message.full_name.startswith("google.protobuf."):
        return []
    if field.is_repeated and isinstance(value, list):
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    else:
        items = [(path, value)]
    found: list[tuple[str, Any]] = []
    for item_path, item in items:
        for key, sub in item.items() if isinstance(item, dict) else []:
            inner = _proto_field(message, key)
            if inner is None:
                found.append((_join(item_path, key), sub))
            else:
                found += _proto_extras(inner, sub, _join(item_path, key))
    return found


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
