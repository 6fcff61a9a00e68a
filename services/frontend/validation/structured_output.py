"""Structured output: every API form becomes one grammar, checked before dispatch.

OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older ``guided_*``
fields all become one of ``SamplingParams.json_schema`` / ``regex`` / ``ebnf`` (SGLang's
names, which the native API takes as they are). A request that uses two forms is refused
naming both, and every later error about the grammar names the field the client used
(``RequestedParams.aliases``).

``GrammarChecker`` then builds the grammar with xgrammar on a worker thread, once per
distinct grammar, so an invalid schema, regex or grammar is an INVALID_ARGUMENT (HTTP 400)
before any scheduler sees the request. The token-level compile against the model's
vocabulary is the scheduler's: it needs the LM head's width, and its result is big.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from google.protobuf import json_format, struct_pb2
from tokenline.v1 import openai_pb2

from services.common.errors import InvalidArgumentError
from services.common.grammar import GrammarError, build_grammar, choice_ebnf
from services.common.sampling_params import GrammarKind, GrammarSpec, SamplingParams

# OpenAI's json_object: any JSON object (SGLang sends the same schema for it).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# (client field, kind, grammar text) for each form a request used.
_Form = tuple[str, GrammarKind, str]


def apply_openai_structured_output(
    params: SamplingParams, aliases: dict[str, str], sampling: openai_pb2.OpenAISampling
) -> None:
    """Set the request's grammar from whichever form it used (at most one), and record
    which client field each grammar field came from, for error messages."""
    forms = [
        *_response_format(sampling),
        *_structured_outputs(sampling),
        *_guided(sampling),
    ]
    if len(forms) > 1:
        raise InvalidArgumentError(
            f"set only one of {forms[0][0]} and {forms[1][0]}", field=forms[1][0]
        )
    for field, kind, text in forms:
        setattr(params, kind, text)
        aliases[kind] = field


def _response_format(sampling: openai_pb2.OpenAISampling) -> list[_Form]:
    if not sampling.HasField("response_format"):
        return []
    fmt = sampling.response_format
    if fmt.type not in ("", *RESPONSE_FORMAT_TYPES):
        raise InvalidArgumentError(
            f"must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {fmt.type!r}",
            field="response_format.type",
        )
    if fmt.type == "json_object":
        return [("response_format", "json_schema", JSON_OBJECT_SCHEMA)]
    if fmt.type != "json_schema":
        return []
    field = "response_format.json_schema.schema"
    spec = fmt.json_schema
    if spec.schema_json:
        return [(field, "json_schema", spec.schema_json)]
    if not spec.HasField("schema"):
        raise InvalidArgumentError("a json_schema response_format needs a schema", field=field)
    return [(field, "json_schema", struct_to_json(spec.schema))]


def _structured_outputs(sampling: openai_pb2.OpenAISampling) -> list[_Form]:
    if not sampling.HasField("structured_outputs"):
        return []
    so = sampling.structured_outputs
    forms = _vllm_forms(so, "structured_outputs.", ("json", "regex", "choice", "grammar"))
    if so.json_object:
        forms.append(("structured_outputs.json_object", "json_schema", JSON_OBJECT_SCHEMA))
    return forms


def _guided(sampling: openai_pb2.OpenAISampling) -> list[_Form]:
    names = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
    return _vllm_forms(sampling, "", names)


def _vllm_forms(message: Any, prefix: str, names: tuple[str, str, str, str]) -> list[_Form]:
    """vLLM's json / regex / choice / grammar fields, as they stand in ``message`` under
    ``names``; each form's client field is ``prefix`` + its name."""
    json_name, regex_name, choice_name, grammar_name = names
    forms: list[_Form] = []
    if message.HasField(json_name):
        forms.append((prefix + json_name, "json_schema", getattr(message, json_name)))
    if message.HasField(regex_name):
        forms.append((prefix + regex_name, "regex", getattr(message, regex_name)))
    if choices := list(getattr(message, choice_name)):
        forms.append((prefix + choice_name, "ebnf", choice_ebnf(choices)))
    if message.HasField(grammar_name):
        forms.append((prefix + grammar_name, "ebnf", getattr(message, grammar_name)))
    return forms


def struct_to_json(struct: struct_pb2.Struct) -> str:
    """A Struct as JSON text. Struct numbers are doubles; whole ones go back to integers,
    since schema keywords such as maxLength must be integers."""
    return json.dumps(_whole_numbers(json_format.MessageToDict(struct)), ensure_ascii=False)


def _whole_numbers(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


class BuildCache(Generic[K, V]):
    """``build(key)`` on one worker thread, once per key, for the ``max_entries`` most
    recently used keys; concurrent requests for one key share one build."""

    def __init__(self, build: Callable[[K], V], max_entries: int, thread_name: str) -> None:
        self.build = build
        self.max_entries = max_entries
        self.thread_name = thread_name
        self._results: OrderedDict[K, Future[V]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self._results)

    async def get(self, key: K) -> V:
        # Shielded: a cancelled client must not cancel a build other requests wait for.
        return await asyncio.shield(asyncio.wrap_future(self._future(key)))

    def _future(self, key: K) -> Future[V]:
        future = self._results.get(key)
        if future is not None:
            self._results.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.thread_name)
        future = self._pool.submit(self.build, key)
        self._results[key] = future
        while len(self._results) > self.max_entries:
            self._results.popitem(last=False)
        return future


class GrammarChecker:
    """Checks that a request's grammar parses, off the event loop, once per grammar.

    Results (None, or the client-facing error) are kept for the ``max_entries`` most
    recently used grammars; concurrent requests with the same grammar share one build.
    """

    def __init__(self, max_entries: int = 512) -> None:
        self._errors = BuildCache(_error_of, max_entries, "grammar-check")

    async def check(self, params: SamplingParams, aliases: dict[str, str]) -> None:
        """INVALID_ARGUMENT naming the client's field when the grammar does not parse."""
        spec = params.grammar
        if spec is None:
            return
        error = await self._errors.get(spec)
        if error is not None:
            raise InvalidArgumentError(error, field=aliases.get(spec.kind, spec.kind))


def _error_of(spec: GrammarSpec) -> str | None:
    try:
        build_grammar(spec)
    except GrammarError as exc:
        return str(exc)
    return None
