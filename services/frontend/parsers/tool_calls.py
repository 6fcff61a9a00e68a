"""Tool-call parsers: a model's tool-call syntax -> OpenAI tool calls, incrementally.

One parser per choice. ``feed(text)`` takes the next piece of the choice's content (the
reasoning already split off) and returns what is now certain: plain content, and
tool-call deltas (a call's index, id and name first, then fragments of its arguments).
``finish()`` flushes what was held back. ``parse(text)`` is both on the whole text, so a
streamed choice's deltas concatenate to the non-streamed result, however the text was
cut (the tests cut it at every point).

Text is held back only while it could still be part of a tool-call marker or header.
A call's arguments are the model's own JSON text, passed on as it arrives; a call the
parser cannot read as such (arguments before the name, say) is read whole once complete,
and its arguments are then re-serialised. Whitespace next to a call separates calls and
is not content. A call's name is not checked against the request's tools: under "auto"
the model's call is reported as written, and "required" or a named tool_choice already
forced a declared name by grammar.

Each format also says how it writes a call (``call_begin`` / ``CALL_END`` /
``SEPARATOR`` / ``SECTION_*``), which ``serving/tool_choice.py`` turns into the grammar that
forces calls, so a forced call is exactly what the parser reads.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import regex

JSON_NAME = r'"((?:[^"\\]|\\.)*)"'
# A header this long that still only partly matches is not a header.
MAX_HEADER_CHARS = 1024


@dataclass(slots=True)
class ToolCallDelta:
    """One step of one call: the first for a call has its id and name, the rest arguments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class ParsedText:
    """What a piece of text turned out to be: plain content and tool-call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedText) -> None:
        self.content += other.content
        self.calls += other.calls

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def merge_calls(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Deltas -> one entry per call (id and name from its first delta, arguments joined)."""
    calls: dict[int, ToolCallDelta] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ToolCallDelta(d.index, d.id, d.name))
        call.arguments += d.arguments
    return list(calls.values())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that ``marker`` starts with (it may complete)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def call_from_json(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) from a whole ``{"name": ..., "arguments"|"parameters": {...}}``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters"))
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


@dataclass(slots=True)
class JsonScan:
    """Where a JSON object or array ends, fed piece by piece (strings and escapes respected)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end(self, text: str) -> int:
        """Index just past the close of the outermost value in ``text``, or -1."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1


class ToolParser:
    """The incremental machinery every format shares; a format supplies ``_step``."""

    NAME: ClassVar[str]
    SECTION_BEGIN: ClassVar[str] = ""  # written once before the calls (grammar only)
    SECTION_END: ClassVar[str] = ""
    SEPARATOR: ClassVar[str] = ""  # between two calls
    CALL_END: ClassVar[str]

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self.new_id = new_id
        self.buf = ""
        self.state = "text"
        self.num_calls = 0
        self._out = ParsedText()
        self._ws = ""  # trailing whitespace: content, or a separator next to a call
        self._after_call = False

    @classmethod
    def call_begin(cls, name: str) -> str:
        """The text that opens a call to ``name``; its JSON arguments and CALL_END follow."""
        raise NotImplementedError

    def feed(self, text: str) -> ParsedText:
        self.buf += text
        while self.buf and self._step(final=False):
            pass
        return self._take()

    def finish(self) -> ParsedText:
        while self._step(final=True):  # every state ends on an empty buffer
            pass
        self.buf = ""
        if not self._after_call:
            self._out.content += self._ws
        self._ws = ""
        return self._take()

    def parse(self, text: str) -> ParsedText:
        """One shot: the calls merged (one entry each)."""
        out = self.feed(text)
        out.extend(self.finish())
        out.calls = merge_calls(out.calls)
        return out

    def _step(self, final: bool) -> bool:
        """Consume what the state can decide from ``buf``; False when it must wait."""
        raise NotImplementedError

    def _take(self) -> ParsedText:
        out, self._out = self._out, ParsedText()
        return out

    # ---- what a step reports ----

    def _text(self, text: str) -> None:
        """Text that is certainly not part of a call."""
        text = self._ws + text
        if self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        self._ws = text[len(body) :]
        if body:
            self._after_call = False
            self._out.content += body

    def _call_starts(self, name: str) -> None:
        self._ws = ""
        self._out.calls.append(ToolCallDelta(self.num_calls, self.new_id(), name))
        self.num_calls += 1

    def _arguments(self, text: str) -> None:
        if text:
            self._out.calls.append(ToolCallDelta(self.num_calls - 1, arguments=text))

    def _whole_call(self, name: str, arguments: str) -> None:
        self._call_starts(name)
        self._arguments(arguments)
        self._call_ends()

    def _call_ends(self) -> None:
        self._ws = ""
        self._after_call = True

    # ---- shared steps ----

    def _rest_is_text(self) -> bool:
        """Everything buffered is content (the output is not, or no longer, calls)."""
        self._text(self.buf)
        self.buf = ""
        return False

    def _text_until(self, marker: str, final: bool) -> bool:
        """Plain text up to ``marker``; True (marker consumed) once it is found."""
        i = self.buf.find(marker)
        if i >= 0:
            self._text(self.buf[:i])
            self.buf = self.buf[i + len(marker) :]
            return True
        keep = 0 if final else held_prefix(self.buf, marker)
        self._text(self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _match(
        self, pattern: regex.Pattern[str], final: bool
    ) -> regex.Match[str] | None | Literal["wait"]:
        """A full match at the start of ``buf`` (consumed); "wait" while more text may
        still make one; None when none can."""
        m = pattern.match(self.buf, partial=not final)
        if m is None:
            return None
        if m.partial:
            return "wait" if len(self.buf) <= MAX_HEADER_CHARS else None
        self.buf = self.buf[m.end() :]
        return m

    def _json_arguments(self, scan: JsonScan) -> bool:
        """Arguments text up to the close of the object; True once it closed."""
        end = scan.end(self.buf)
        cut = len(self.buf) if end < 0 else end
        self._arguments(self.buf[:cut])
        self.buf = self.buf[cut:]
        return end >= 0


def header_name(parser: ToolParser, m: regex.Match[str] | None) -> str | None:
    """The called name from a header match (a JSON string's body), or None. A name JSON
    cannot read gives the header's text back, to be read whole."""
    if m is None:
        return None
    try:
        return str(json.loads(f'"{m.group(1)}"'))
    except json.JSONDecodeError:
        parser.buf = m.group(0) + parser.buf
        return None


class HermesParser(ToolParser):
    """Hermes, Qwen2.5, Qwen3:
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number."""

    NAME = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    CALL_END = "}\n</tool_call>"
    SEPARATOR = "\n"
    HEADER = regex.compile(
        r'\s*\{\s*"name"\s*:\s*' + JSON_NAME + r'\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'
    )

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.scan = JsonScan()

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            if self._text_until(self.START, final):
                self.state = "header"
                return True
            return False
        if self.state == "header":
            return self._header(final)
        if self.state == "arguments":
            if self._json_arguments(self.scan):
                self.state = "tail"
                return True
            return False
        if self.state == "tail":  # the rest of the call object, up to the end tag
            i = self.buf.find(self.END)
            if i < 0 and not final:
                return False
            self.buf = "" if i < 0 else self.buf[i + len(self.END) :]
            self._call_ends()
            self.state = "text"
            return True
        return self._whole(final)

    def _header(self, final: bool) -> bool:
        m = self._match(self.HEADER, final)
        if m == "wait":
            return False
        name = header_name(self, m)
        if name is None:
            self.state = "whole"
            return True
        self._call_starts(name)
        self.scan = JsonScan(depth=1)
        self._arguments("{")
        self.state = "arguments"
        return True

    def _whole(self, final: bool) -> bool:
        """A call read only once complete: the header did not have the usual shape."""
        i = self.buf.find(self.END)
        if i < 0 and not final:
            return False
        body = self.buf if i < 0 else self.buf[:i]
        self.buf = "" if i < 0 else self.buf[i + len(self.END) :]
        call = call_from_json(body)
        if call is None:
            self._text(self.START + body + ("" if i < 0 else self.END))
        else:
            self._whole_call(*call)
        self.state = "text"
        return True


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calling: the whole output is ``{"name": ..., "parameters": {...}}``
    (optionally after ``<|python_tag|>``), several joined by ``; ``. Output that does not
    start as such is content."""

    NAME = "llama3_json"
    CALL_END = "}"
    SEPARATOR = "; "
    HEADER = regex.compile(
        r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*'
        + JSON_NAME
        + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*\{'
    )
    OBJECT = regex.compile(r"\s*(?:<\|python_tag\|>)?\s*(?=\{)")
    NEXT = regex.compile(r"\s*;")

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.state = "header"
        self.scan = JsonScan()
        self.prefix = ""  # what came before an object read whole
        self.num_scanned = 0  # of buf, by the scan of an object read whole

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": '

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            return self._rest_is_text()
        if self.state == "header":
            return self._header(final)
        if self.state == "arguments":
            if self._json_arguments(self.scan):
                self.scan, self.state = JsonScan(depth=1), "tail"
                return True
            return False
        if self.state == "tail":  # the rest of the call object
            end = self.scan.end(self.buf)
            self.buf = "" if end < 0 else self.buf[end:]
            if end >= 0 or final:
                self._call_ends()
                self.state = "between"
            return end >= 0
        if self.state == "between":
            m = self._match(self.NEXT, final)
            if m == "wait":
                return False
            self.state = "text" if m is None else "header"
            return True
        return self._whole(final)

    def _header(self, final: bool) -> bool:
        m = self._match(self.HEADER, final)
        if m == "wait":
            return False
        name = header_name(self, m)
        if name is not None:
            self._call_starts(name)
            self.scan = JsonScan(depth=1)
            self._arguments("{")
            self.state = "arguments"
            return True
        opens = self.OBJECT.match(self.buf)
        if opens is None:
            self.state = "text"
        else:
            self.prefix, self.buf = self.buf[: opens.end()], self.buf[opens.end() :]
            self.scan, self.num_scanned, self.state = JsonScan(), 0, "whole"
        return True

    def _whole(self, final: bool) -> bool:
        """An object read only once complete; a call if it has a name and parameters."""
        end = self.scan.end(self.buf[self.num_scanned :])
        if end < 0 and not final:
            self.num_scanned = len(self.buf)
            return False
        cut = len(self.buf) if end < 0 else self.num_scanned + end
        body, self.buf = self.buf[:cut], self.buf[cut:]
        call = call_from_json(body)
        if call is None:
            self._text(self.prefix + body)
            self.state = "text"
        else:
            self._whole_call(*call)
            self.state = "between"
        return True


class DeepSeekV31Parser(ToolParser):
    """DeepSeek-V3.1, and the embedded default model's template:
    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>``."""

    NAME = "deepseek_v31"
    SECTION_BEGIN = "<｜tool▁calls▁begin｜>"
    SECTION_END = "<｜tool▁calls▁end｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    HEADER = regex.compile(r"\s*<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>", regex.DOTALL)
    SECTION_CLOSE = regex.compile(r"\s*<｜tool▁calls▁end｜>")

    @classmethod
    def call_begin(cls, name: str) -> str:
        return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>"

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            if self._text_until(self.SECTION_BEGIN, final):
                self._ws = ""
                self.state = "calls"
                return True
            return False
        if self.state == "calls":
            return self._calls(final)
        # arguments: raw text up to the call's end marker
        if self._text_until_end(final):
            self.state = "calls"
            return True
        return False

    def _calls(self, final: bool) -> bool:
        m = self._match(self.HEADER, final)
        if m == "wait":
            return False
        if isinstance(m, regex.Match):
            self._call_starts(m.group(1).strip())
            self.state = "arguments"
            return True
        if self._match(self.SECTION_CLOSE, final) == "wait":
            return False
        self._call_ends()
        self.state = "text"
        return True

    def _text_until_end(self, final: bool) -> bool:
        i = self.buf.find(self.CALL_END)
        if i >= 0:
            self._arguments(self.buf[:i])
            self.buf = self.buf[i + len(self.CALL_END) :]
            return True
        keep = 0 if final else held_prefix(self.buf, self.CALL_END)
        self._arguments(self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
    "deepseek_v31": DeepSeekV31Parser,
}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser registered as ``name`` (a flag's value); ValueError names the choices."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        choices = sorted(TOOL_PARSERS)
        raise ValueError(f"unknown tool-call parser {name!r}; one of {choices}") from None
