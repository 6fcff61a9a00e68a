"""SSE frames of plain text chunks, written from a template the response models rendered.

Most frames of a stream differ from the one before only in their new text: a chat
chunk's ``delta.content`` or a completion chunk's ``text``, with the same id, created,
model and choice index. Building the response models for each (validation, then
serialisation) cost about 10 µs a frame on the 2-core EPYC, once per token per stream.
Here, at a choice's first plain chunk, the models render a copy of it with a marker in
place of the text; that chunk and every later plain one of the choice is the template's
bytes around its own text, serialised by pydantic-core, the serialiser the models use.
So a frame is byte-for-byte what the models write. Any other chunk (a role, a finish,
logprobs, token ids, usage, reasoning, tool calls, several choices) goes to the models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic_core
from google.protobuf.message import Message

_MARKER = "tokenline-text-slot-5f1c"
_MARKER_JSON = pydantic_core.to_json(_MARKER)

_HEADER_FIELDS = frozenset({"id", "object", "created", "model", "choices"})
_CHOICE_OF_CHAT = frozenset({"index", "delta"})
_CHOICE_OF_COMPLETION = frozenset({"index", "text"})
_CONTENT = frozenset({"content"})

# A chunk type's fields besides its header, each as (name, how to test it), read from
# the descriptor: a field added to the proto later makes a chunk that sets it go to the
# models. For a chunk this is cheaper than ``ListFields``, which builds the choices'
# container (1.25 µs against 0.4); for a choice or a delta ``ListFields`` is the cheaper.
_REPEATED, _PRESENCE, _SCALAR = 0, 1, 2
_chunk_extras: dict[Any, tuple[tuple[str, int], ...]] = {}


def _header_only(chunk: Message) -> bool:
    """The chunk sets no field besides its header and its choices."""
    descriptor = chunk.DESCRIPTOR
    extras = _chunk_extras.get(descriptor)
    if extras is None:
        extras = _chunk_extras[descriptor] = tuple(
            (f.name, _REPEATED if f.is_repeated else _PRESENCE if f.has_presence else _SCALAR)
            for f in descriptor.fields
            if f.name not in _HEADER_FIELDS
        )
    for name, kind in extras:
        if kind == _PRESENCE:
            if chunk.HasField(name):
                return False
        elif getattr(chunk, name):  # a non-empty list, or a scalar off its default
            return False
    return True


def _sets_only(message: Message, allowed: frozenset[str]) -> bool:
    """No field of ``message`` outside ``allowed`` is set."""
    for field, _ in message.ListFields():  # noqa: SIM110 - all() and a generator: +0.4 µs
        if field.name not in allowed:
            return False
    return True


def _only_choice(chunk: Any) -> Any | None:
    """The chunk's one choice, when the chunk sets nothing but its header and it."""
    if len(chunk.choices) != 1 or not _header_only(chunk):
        return None
    return chunk.choices[0]


def chat_text(chunk: Any) -> tuple[Any, str] | None:
    """(choice, its delta's content) when the chunk carries only that text."""
    choice = _only_choice(chunk)
    if choice is None or not _sets_only(choice, _CHOICE_OF_CHAT):
        return None
    delta = choice.delta
    if not delta.HasField("content") or not _sets_only(delta, _CONTENT):
        return None
    return choice, delta.content


def set_chat_text(choice: Any, text: str) -> None:
    choice.delta.content = text


def completion_text(chunk: Any) -> tuple[Any, str] | None:
    """(choice, its text) when the chunk carries only that text."""
    choice = _only_choice(chunk)
    if choice is None or not choice.text or not _sets_only(choice, _CHOICE_OF_COMPLETION):
        return None
    return choice, choice.text


def set_completion_text(choice: Any, text: str) -> None:
    choice.text = text


@dataclass(frozen=True, slots=True)
class TextSlot:
    """Where a kind of chunk keeps its text: ``find`` returns (choice, text) for a plain
    chunk and None for any other; ``put`` sets a choice's text."""

    find: Callable[[Any], tuple[Any, str] | None]
    put: Callable[[Any, str], None]


CHAT_TEXT = TextSlot(chat_text, set_chat_text)
COMPLETION_TEXT = TextSlot(completion_text, set_completion_text)


Frame = Callable[[Any], bytes]


class TextFrames:
    """One stream's frames: the same bytes as ``frame(chunk)``, which renders a chunk
    through the response models, for every chunk."""

    def __init__(self, frame: Frame, slot: TextSlot) -> None:
        self.frame = frame
        self.slot = slot
        # (id, created, model, choice index) -> the frame's bytes before and after the
        # text; None when the marker did not come out exactly once (never templated).
        self._templates: dict[tuple[str, int, str, int], tuple[bytes, bytes] | None] = {}

    def __call__(self, chunk: Any) -> bytes:
        found = self.slot.find(chunk)
        if found is None or not chunk.created:  # no created: the models write the time now
            return self.frame(chunk)
        choice, text = found
        key = (chunk.id, chunk.created, chunk.model, choice.index)
        if key not in self._templates:
            self._templates[key] = self._template(chunk)
        template = self._templates[key]
        if template is None:
            return self.frame(chunk)
        head, tail = template
        return head + pydantic_core.to_json(text) + tail

    def _template(self, chunk: Any) -> tuple[bytes, bytes] | None:
        marked = type(chunk)()
        marked.CopyFrom(chunk)
        self.slot.put(marked.choices[0], _MARKER)
        frame = self.frame(marked)
        if frame.count(_MARKER_JSON) != 1:
            return None
        head, _, tail = frame.partition(_MARKER_JSON)
        return head, tail
