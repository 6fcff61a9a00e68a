"""The frames of the pipe between the scheduler's gRPC process and its engine process:
any message of the engine boundary (``core/commands.py``, ``core/messages.py``) as one
Protobuf ``Value`` (``proto/tokenline/v1/engine.proto``), a self-describing tree of plain
data. Generic: a command or output declared once crosses as it is, with no code here or
message in the proto about it.

Why Protobuf: the pipe is a process boundary, and invariant 5 (docs/architecture.md)
allows nothing else across one: pickled objects over sockets gave SGLang its
remote-code-execution CVEs, because unpickling runs whatever callable a frame names.
A ``Value`` names no code. Decoding builds only what ``BoundaryTypes`` registered, once,
by walking the type hints of every command, its answer, ``EngineOutput`` and
``EngineLimits`` (every dataclass and enum they reach, ``Req`` and its parts included)
plus every ``TokenlineError``: a record is rebuilt through its class's own ``__init__``
(or, for an error, as ``BaseException.__reduce__`` describes it) from decoded plain data,
and a frame naming anything else fails to decode with ``CodecError``. No class is looked
up by a name read from a frame outside that registry.

How values go: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes`` as scalars; a
list or tuple whose items are all ints (token ids), or all floats (embeddings, latency
samples), packed; any other list, tuple or dict item by item; a dataclass as a ``Record``
of its type's name and its field values in order, less the trailing ones equal to their
defaults; an enum as its value; an error as its arguments and attributes. Lists and
tuples keep their kind, so what decodes compares equal to what was encoded, field by field.

Speed: a step's rows cross every step, the pipe's one hot message. A tuple of
``OutputRow``s goes as the detokenizer's typed ``TokenIDRow``s (``proto_codec``), about
3.5x cheaper for the engine to write than generic records (the logprobs it carries are
float32 there, as the sampler made them); everything else is generic
(docs/benchmarks.md#the-engine-pipes-codec).
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from tokenline.v1.engine_pb2 import Record, Value, Values

from services.common import errors as errors_module
from services.common.errors import TokenlineError
from services.scheduler.core import commands as commands_module
from services.scheduler.core.commands import EngineCommand
from services.scheduler.core.messages import EngineLimits, EngineOutput
from services.scheduler.core.output_row import OutputRow
from services.scheduler.mem_cache.radix_cache import TreeNode
from services.scheduler.sampling.grammar import RequestGrammar
from services.scheduler.sampling.logits_processor import PenaltyState
from services.scheduler.transport.proto_codec import row_from_pb, write_rows

# What the engine attaches to a ``Req`` (or a request's state) once it holds it: live
# objects, never set on anything that crosses, so never registered. A field of any other
# type that is not plain data fails ``BoundaryTypes`` at import, not a frame at run time.
ENGINE_ONLY: frozenset[type] = frozenset(
    {TreeNode, RequestGrammar, PenaltyState, torch.Generator, torch.Tensor}
)
_SCALARS = (type(None), bool, int, float, str, bytes, object)  # object: an ``Answer``
_FLOATS_ONLY = {float}
_ROWS_ONLY = {OutputRow}
_REQUIRED = object()  # a dataclass field without a default


class CodecError(ValueError):
    """A message holds, or a frame names, something that may not cross the engine pipe."""


def encode(message: object) -> bytes:
    """One frame: any message of the engine boundary (commands, outputs, the engine's
    limits), nested plain data included."""
    frame = Value()
    _put(message, frame)
    return frame.SerializeToString()


def decode(frame: bytes) -> Any:
    """The message ``encode`` made; ``CodecError`` for a type outside the registry."""
    return _get(Value.FromString(frame))


# ---- which types may cross ---------------------------------------------------------


class BoundaryTypes:
    """Every class a frame may name: the dataclasses and enums reachable from the
    boundary's messages through their type hints, and the ``TokenlineError``s. Walked
    once; a reachable type that is neither plain data nor ``ENGINE_ONLY`` is an error."""

    def __init__(self, roots: Iterable[type]) -> None:
        self.by_name: dict[str, type] = {}
        for root in roots:
            self._add(root, root.__qualname__)

    @classmethod
    def of_boundary(cls) -> BoundaryTypes:
        """Every command declared in ``core/commands.py`` and what it answers, the engine's
        outputs and limits, and every error declared in ``services/common/errors.py``."""
        commands = _declared_in(commands_module, EngineCommand)
        answers = [_answer_type(command) for command in commands]
        errors = [TokenlineError, *_declared_in(errors_module, TokenlineError)]
        return cls([*commands, *answers, EngineOutput, EngineLimits, *errors])

    def _add(self, hint: Any, via: str) -> None:
        if isinstance(hint, type) and typing.get_origin(hint) is None:
            self._add_class(hint, via)
            return
        origin = typing.get_origin(hint)
        if origin is typing.Literal:
            return
        if origin not in (list, tuple, dict, typing.Union, types.UnionType):
            raise TypeError(f"{via}: {hint} cannot cross the engine pipe")
        for arg in typing.get_args(hint):
            if arg is not Ellipsis:
                self._add(arg, via)

    def _add_class(self, cls: type, via: str) -> None:
        if cls in _SCALARS or cls in (list, tuple, dict) or cls in ENGINE_ONLY:
            return
        if self.by_name.get(cls.__qualname__) is cls:
            return
        if cls.__qualname__ in self.by_name:
            raise TypeError(f"two types named {cls.__qualname__} would cross the engine pipe")
        if issubclass(cls, (enum.Enum, TokenlineError)):
            self.by_name[cls.__qualname__] = cls
        elif dataclasses.is_dataclass(cls):
            self._add_dataclass(cls)
        else:
            raise TypeError(
                f"{via}: {cls.__module__}.{cls.__qualname__} cannot cross the engine pipe: "
                "make it a dataclass, or list it in ENGINE_ONLY if it never crosses"
            )

    def _add_dataclass(self, cls: type) -> None:
        fields = dataclasses.fields(cls)
        if any(not f.init or f.kw_only for f in fields):
            raise TypeError(f"{cls.__qualname__}: every field must be a positional __init__ one")
        self.by_name[cls.__qualname__] = cls
        hints = typing.get_type_hints(cls)
        for f in fields:
            self._add(hints[f.name], f"{cls.__qualname__}.{f.name}")


def _declared_in(module: types.ModuleType, base: type) -> list[type]:
    """The subclasses of ``base`` that ``module`` declares. Not
    ``__subclasses__``: a slotted dataclass replaces its class, and the first one lingers."""
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, base)
        and value is not base
        and value.__module__ == module.__name__
    ]


def _answer_type(command: type) -> Any:
    """The ``T`` of a command's ``EngineCommand[T]`` base: what its answer may be."""
    for base in getattr(command, "__orig_bases__", ()):
        if typing.get_origin(base) is EngineCommand:
            return typing.get_args(base)[0]
    return type(None)


# ---- encoding ----------------------------------------------------------------------

Writer = Callable[[Any, Value], None]


def _put(value: Any, out: Value) -> None:
    writer = _WRITERS.get(type(value))
    if writer is None:
        raise CodecError(f"{type(value).__qualname__} may not cross the engine pipe")
    writer(value, out)


def _put_none(value: None, out: Value) -> None:
    out.none = True


def _scalar(name: str) -> Writer:
    return lambda value, out: setattr(out, name, value)


def _sequence(ints: str, floats: str, values: str) -> Writer:
    """A list or a tuple: packed when every item is an int (Protobuf refuses the
    rest, bools included) or every item a float, else item by item."""

    def put(items: list[Any] | tuple[Any, ...], out: Value) -> None:
        if items:
            first = type(items[0])
            if first is int:
                try:
                    getattr(out, ints).values.extend(items)
                    return
                except (TypeError, ValueError):
                    pass
            elif first is float and set(map(type, items)) == _FLOATS_ONLY:
                getattr(out, floats).values.extend(items)
                return
        _put_all(items, getattr(out, values))

    return put


_put_list = _sequence("int_list", "float_list", "list")
_put_other_tuple = _sequence("int_tuple", "float_tuple", "tuple")


def _put_tuple(items: tuple[Any, ...], out: Value) -> None:
    """A step's rows as typed ``TokenIDRow``s (the hot path); any other tuple generically."""
    if items and type(items[0]) is OutputRow and set(map(type, items)) == _ROWS_ONLY:
        write_rows(items, out.output_rows)
    else:
        _put_other_tuple(items, out)


def _put_all(items: Iterable[Any], out: Values) -> None:
    out.SetInParent()  # an empty sequence still says which kind it is
    add = out.values.add
    for item in items:
        _put(item, add())


def _put_dict(value: dict[Any, Any], out: Value) -> None:
    _put_all((x for item in value.items() for x in item), out.dict_items)


def _record(name: str, values: Callable[[Any], Iterable[Any]]) -> Writer:
    def put(obj: Any, out: Value) -> None:
        record: Record = out.record
        record.type = name
        add = record.fields.add
        for value in values(obj):
            _put(value, add())

    return put


def _record_writer(cls: type) -> Writer:
    name = cls.__qualname__
    if issubclass(cls, enum.Enum):
        return _record(name, lambda member: (member.value,))
    if issubclass(cls, BaseException):
        return _record(name, lambda error: (error.args, error.__dict__))
    return _record(name, _leading_fields(cls))


def _leading_fields(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    """A dataclass's field values in order, less the trailing ones equal to their
    defaults (its ``__init__`` fills those in): a ``Req`` crosses before the engine set
    any of its own state, which is half its fields."""
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    getter: Callable[[Any], tuple[Any, ...]] = (
        operator.attrgetter(*names)
        if len(names) > 1
        else lambda obj: tuple(getattr(obj, name) for name in names)  # attrgetter's 0 or 1
    )
    defaults = [_default(f) for f in fields]

    def values(obj: Any) -> tuple[Any, ...]:
        found = getter(obj)
        end = len(found)
        while end and _is_default(found[end - 1], defaults[end - 1]):
            end -= 1
        return found[:end]

    return values


def _default(field: dataclasses.Field[Any]) -> Any:
    """What ``__init__`` gives ``field`` when left out (a fresh one of a factory's, only
    compared with); ``_REQUIRED`` when it must be given."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _REQUIRED


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


# ---- decoding ----------------------------------------------------------------------


def _get(value: Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind is None:
        raise CodecError("an empty value on the engine pipe")
    return _READERS[kind](value)


def _get_record(value: Value) -> Any:
    record = value.record
    build = _BUILDERS.get(record.type)
    if build is None:
        raise CodecError(f"{record.type!r} may not cross the engine pipe")
    return build(*map(_get, record.fields))


def _get_dict(value: Value) -> dict[Any, Any]:
    items: Iterator[Any] = map(_get, value.dict_items.values)
    return dict(zip(items, items, strict=True))


def _build_error(cls: type[BaseException]) -> Callable[..., BaseException]:
    """An error as ``BaseException.__reduce__`` describes it: its class, its arguments,
    its attributes; never through its ``__init__``, whose keywords vary."""

    def build(args: tuple[Any, ...], attributes: dict[str, Any]) -> BaseException:
        error = cls.__new__(cls, *args)
        error.args = args
        error.__dict__.update(attributes)
        return error

    return build


def _builder(cls: type) -> Callable[..., Any]:
    return _build_error(cls) if issubclass(cls, BaseException) else cls


def _packed(field: str, into: type) -> Callable[[Value], Any]:
    """A slice copies a repeated scalar in C; iterating it costs about 3x as much."""
    get = operator.attrgetter(f"{field}.values")
    if into is list:
        return lambda value: get(value)[:]
    return lambda value: into(get(value)[:])


def _values(field: str, into: type) -> Callable[[Value], Any]:
    get = operator.attrgetter(f"{field}.values")
    return lambda value: into(map(_get, get(value)))


BOUNDARY = BoundaryTypes.of_boundary()

_WRITERS: dict[type, Writer] = {
    type(None): _put_none,
    bool: _scalar("bool_value"),
    int: _scalar("int_value"),
    float: _scalar("float_value"),
    str: _scalar("str_value"),
    bytes: _scalar("bytes_value"),
    list: _put_list,
    tuple: _put_tuple,
    dict: _put_dict,
    **{cls: _record_writer(cls) for cls in BOUNDARY.by_name.values()},
}
_READERS: dict[str, Callable[[Value], Any]] = {
    "none": lambda value: None,
    **{
        kind: operator.attrgetter(kind)
        for kind in ("bool_value", "int_value", "float_value", "str_value", "bytes_value")
    },
    "int_list": _packed("int_list", list),
    "int_tuple": _packed("int_tuple", tuple),
    "float_list": _packed("float_list", list),
    "float_tuple": _packed("float_tuple", tuple),
    "list": _values("list", list),
    "tuple": _values("tuple", tuple),
    "dict_items": _get_dict,
    "record": _get_record,
    "output_rows": lambda value: tuple(map(row_from_pb, value.output_rows.rows)),
}
_BUILDERS: dict[str, Callable[..., Any]] = {
    name: _builder(cls) for name, cls in BOUNDARY.by_name.items()
}
