"""The plain JSON a forced tool_choice writes when the server runs no ``--tool-call-parser``.

Without a parser the model's own call syntax is unknown, so the grammar forces a shape the
server reads back itself: for ``"required"`` a JSON list of ``{"name", "arguments"}``
objects, for a named function only that function's arguments object. Each class says how
the grammar writes it (``call_begin`` / ``CALL_END`` / ``SEPARATOR`` / ``SECTION_*``, as
every format in ``tool_calls.py`` does) and reads it incrementally like any parser, so the
streamed deltas concatenate to the non-streamed calls. Output of another shape (no grammar
forced it) is content.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import regex

from services.frontend.parsers.tool_calls import (
    JSON_NAME,
    JsonScan,
    ToolParser,
    header_name,
    new_call_id,
)


class JsonListParser(ToolParser):
    """``[{"name": N, "arguments": {...}}, ...]``: tool_choice "required"."""

    NAME = "json_list"
    SECTION_BEGIN, SECTION_END = "[", "]"
    SEPARATOR = ", "
    CALL_END = "}"
    OPEN = regex.compile(r"\s*\[")
    HEADER = regex.compile(r'\s*\{\s*"name"\s*:\s*' + JSON_NAME + r'\s*,\s*"arguments"\s*:\s*\{')
    CLOSE = regex.compile(r"\s*\}")
    NEXT = regex.compile(r"\s*(,|\])")

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.state = "open"
        self.scan = JsonScan()

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            return self._rest_is_text()
        if self.state == "arguments":
            if self._json_arguments(self.scan):
                self.state = "close"
                return True
            return False
        patterns = {"open": self.OPEN, "header": self.HEADER, "close": self.CLOSE}
        m = self._match(patterns.get(self.state, self.NEXT), final)
        if m == "wait":
            return False
        self.state = "text" if m is None else self._next_state(m)
        return True

    def _next_state(self, m: regex.Match[str]) -> str:
        """Where a matched piece of the list leads."""
        if self.state == "open":
            return "header"
        if self.state == "header":
            name = header_name(self, m)
            if name is None:
                return "text"
            self._call_starts(name)
            self.scan = JsonScan(depth=1)
            self._arguments("{")
            return "arguments"
        if self.state == "close":
            self._call_ends()
            return "next"
        return "header" if m.group(1) == "," else "text"


class JsonArgumentsParser(ToolParser):
    """The whole output is one call's arguments object: a named tool_choice. The name is
    the request's, so a reader is made per request (``functools.partial``)."""

    NAME = "json_arguments"
    CALL_END = ""

    def __init__(self, name: str, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.name = name
        self.scan = JsonScan()

    @classmethod
    def call_begin(cls, name: str) -> str:
        return ""

    def _step(self, final: bool) -> bool:
        if self.state == "text":  # nothing but whitespace yet
            body = self.buf.lstrip()
            if not body:
                return False
            if body[0] == "{":
                self.buf = body
                self._call_starts(self.name)
                self.state = "arguments"
            else:
                self.state = "content"
            return True
        if self.state == "arguments":
            if self._json_arguments(self.scan):
                self._call_ends()
                self.state = "content"
                return True
            return False
        return self._rest_is_text()
