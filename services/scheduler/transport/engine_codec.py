"""The frames of the pipe between the scheduler's gRPC process and its engine process:
any message of the engine boundary (``core/commands.py``, ``core/messages.py``) as
pickle (protocol 5), as Python's own multiprocessing sends objects. Generic: a command
or output declared once is carried as it is, with no code here about it.

Why pickle is safe here, where every other process boundary is Protobuf (pickled
objects over sockets gave SGLang its remote-code-execution CVEs):

* the pipe is an anonymous OS pipe between the gRPC process and the child it forked;
  it has no address, listens on nothing, and no other process can write to it;
* both ends are the same program at the same version (the child is forked or spawned
  from it), so a frame is never read by code that did not write it: no schema to
  evolve, no version skew;
* and even so, decoding builds nothing but our own plain data: ``find_class``
  resolves only dataclasses, enums and ``TokenlineError``s from ``services``, so a
  corrupt frame fails to decode rather than calling whatever it names.

Speed: rows cross every step. A dataclass goes as its class and field values, rebuilt
through its ``__init__``; the default pickling of a slotted dataclass runs Python
``__getstate__``/``__setstate__`` per object and took about twice as long
(docs/benchmarks.md#the-engine-pipes-codec).
"""

from __future__ import annotations

import copyreg
import dataclasses
import enum
import functools
import importlib
import io
import operator
import pickle
from collections.abc import Callable
from typing import Any

from services.common.errors import TokenlineError

PROTOCOL = 5
_TRUSTED_PACKAGE = "services."
# Pickle writes a reducer of this function as NEWOBJ, ``cls.__new__(cls, *args)``: the
# frame names the class alone (typeshed does not declare it).
_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]


def encode(message: object) -> bytes:
    """One frame: any message of the engine boundary (commands, outputs, the engine's
    limits), nested plain data included."""
    buffer = io.BytesIO()
    _Pickler(buffer, PROTOCOL).dump(message)
    return buffer.getvalue()


def decode(frame: bytes) -> Any:
    """The message ``encode`` made; ``pickle.UnpicklingError`` for anything that is not
    our plain data."""
    return _Unpickler(io.BytesIO(frame)).load()


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        """A dataclass as ``(class, field values)``; an error as its class, arguments and
        attributes, never through its ``__init__`` (whose keywords vary). Python calls
        this only for objects that are not builtin containers or scalars."""
        cls: type = type(obj)
        values = _field_values(cls)
        if values is not None:
            return cls, values(obj)
        if isinstance(obj, TokenlineError):
            return _NEWOBJ, (cls, *obj.args), obj.__dict__
        return NotImplemented


@functools.cache
def _field_values(cls: type) -> Callable[[Any], tuple[Any, ...]] | None:
    """For a dataclass whose ``__init__`` takes every field in order: a C getter of
    their values. None for other types, which pickle the default way."""
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        return None
    fields = dataclasses.fields(cls)
    if any(not f.init or f.kw_only for f in fields):
        return None
    names = [f.name for f in fields]
    if len(names) > 1:
        getter: Callable[[Any], tuple[Any, ...]] = operator.attrgetter(*names)
        return getter
    return lambda obj: tuple(getattr(obj, name) for name in names)  # attrgetter's 0 or 1


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _plain_data_class(module, name)


@functools.cache
def _plain_data_class(module: str, name: str) -> type:
    """Only our plain data: a dataclass, an enum or an error from ``services``."""
    if module.startswith(_TRUSTED_PACKAGE):
        found = getattr(importlib.import_module(module), name, None)
        if isinstance(found, type) and (
            dataclasses.is_dataclass(found) or issubclass(found, (enum.Enum, TokenlineError))
        ):
            return found
    raise pickle.UnpicklingError(f"{module}.{name} may not cross the engine pipe")
