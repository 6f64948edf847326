"""What every tool-call parser shares: the reply types, the streaming machinery and JSON helpers.

A format only says how to read a reply from a position on (`ToolParser.scan`): the content text
and the calls it has decided, in reply order, and where reading may resume. `parse` reads the whole
reply once; `stream` resumes where it stopped, so both see the same items and agree by
construction. A scan of an unfinished reply decides nothing that more text could change: a call
is reported once it is closed, and content stops before anything that may still become a marker.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

_DECODER = json.JSONDecoder()


def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=_new_call_id)


@dataclass
class ParsedReply:
    content: str | None  # the text that is not a tool call; None when there is none
    tool_calls: list[ToolCall]


@dataclass
class Scan:
    """What a format read from its start position: `items` (content text or calls) all lie before
    `resume`, where the next scan starts; `pending` is content after `resume` that the next scan
    reports again, grown (an open message body whose kind only its header tells, or text known to
    be content up to the end of the reply)."""

    items: list[str | ToolCall]
    resume: int
    pending: str = ""


class _Assembler:
    """Items in reply order -> content text and calls. Whitespace between a call and the text
    beside it is dropped where no text lies on its other side (a reply of calls alone has no
    content; "Checking.\n\n<call>" gives "Checking."); between two texts it is kept once, the
    space before the calls. Trailing whitespace is held until it is known what follows."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self._has_text = False
        self._after_call = False
        self._held_space = ""

    def add(self, item: str | ToolCall) -> None:
        if isinstance(item, ToolCall):
            self.calls.append(item)
            self._after_call = True
            if not self._has_text:
                self._held_space = ""
            return
        if self._after_call:
            item = item.lstrip()
            if not item:
                return
            self._after_call = False
        text = item.rstrip()
        if text:
            self.content.append(self._held_space + text)
            self._held_space, self._has_text = "", True
        self._held_space += item[len(text):]

    def finish(self) -> None:
        if not self._after_call:
            self.content.append(self._held_space)
        self._held_space = ""

    def take(self) -> tuple[str, list[ToolCall]]:
        """The content and calls added since the last take."""
        content, calls = "".join(self.content), self.calls
        self.content, self.calls = [], []
        return content, calls


class ToolParser:
    """One instance per generated choice (it keeps streaming state)."""

    name: ClassVar[str]
    # True: the parser reads the raw reply, whose format also carries the reasoning (harmony's
    # channels), rather than the content a reasoning parser leaves.
    reads_whole_reply: ClassVar[bool] = False

    @staticmethod
    def call_id(function: str, index: int) -> str:
        """The id of a call the server writes itself (tool_choice `required` or a named function:
        the constrained reply has no id of its own); index: the call's place in the reply."""
        return _new_call_id()

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []  # the request's tools (OpenAI's shape): formats that write values untyped read them
        self._assembler = _Assembler()
        self._resume = 0  # where the next streaming scan starts
        self._pending_sent = 0  # characters of the content just after _resume already taken
        self._num_calls = 0

    def declared_type(self, function: str, key: str) -> str | None:
        """The JSON type the request's tool `function` gives its parameter `key` (None: not a
        single type, or no such tool): for formats that write argument values untyped."""
        for tool in self.tools:
            spec = tool.get("function") or {}
            if spec.get("name") == function:
                kind = (((spec.get("parameters") or {}).get("properties") or {}).get(key) or {}).get("type")
                return kind if isinstance(kind, str) else None
        return None

    def scan(self, text: str, start: int, finished: bool) -> Scan:
        """Read `text` from `start` (0, or a previous scan's `resume`). Unless `finished`, report
        only what more text cannot change."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedReply:
        """The complete reply split into content and calls."""
        assembler = _Assembler()
        scan = self.scan(text, 0, finished=True)
        for item in [*scan.items, scan.pending]:
            assembler.add(item)
        assembler.finish()
        content, calls = assembler.take()
        return ParsedReply(content or None, calls)

    def stream(self, text: str, finished: bool) -> dict[str, Any]:
        """The chat-completion delta fields new since the previous call; `text` is the whole reply
        so far. A call is sent whole (id, name, arguments) in one delta once it is decided."""
        scan = self.scan(text, self._resume, finished)
        items = [*scan.items, scan.pending] if scan.pending else list(scan.items)
        if self._pending_sent:  # the first item continues content already taken
            items[0] = items[0][self._pending_sent:]
        self._resume, self._pending_sent = scan.resume, len(scan.pending)
        for item in items:
            self._assembler.add(item)
        if finished:
            self._assembler.finish()
        content, calls = self._assembler.take()
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [
                {"index": self._num_calls + i, "id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for i, call in enumerate(calls)]
            self._num_calls += len(calls)
        return delta


def scan_markers(text: str, start: int, finished: bool, openers: tuple[str, ...], read) -> Scan:
    """A ToolParser.scan for formats whose calls and sections open with markers among content:
    read(marker, at) for the first of `openers` found (at its position) gives (the item there: a
    call, its text as content, or None for a section marker, which is dropped; the position after
    it), or None while that call is still being written."""
    items: list[str | ToolCall] = []
    position = start
    while found := [(at, marker) for marker in openers if (at := text.find(marker, position)) >= 0]:
        at, marker = min(found)
        if at > position:
            items.append(text[position:at])
        read_at = read(marker, at)
        if read_at is None:
            return Scan(items, at)
        item, position = read_at
        if item is not None:
            items.append(item)
    end = len(text) if finished else undecided_tail(text, position, openers)
    if end > position:
        items.append(text[position:end])
    return Scan(items, end)


def scan_tagged(text: str, start: int, finished: bool, opening: str, closing: str, read) -> Scan:
    """A ToolParser.scan for calls between `opening` and `closing` tags among content: read(body)
    is the call a tag's body holds, or None (the tagged text then stays content as written). A call
    still open when the reply ends is read from its body to the end."""
    items: list[str | ToolCall] = []
    position = start
    while (at := text.find(opening, position)) >= 0:
        if at > position:
            items.append(text[position:at])
        body_start = at + len(opening)
        close = text.find(closing, body_start)
        if close < 0 and not finished:  # still being written
            return Scan(items, at)
        body_end = close if close >= 0 else len(text)
        position = body_end + len(closing) if close >= 0 else len(text)
        items.append(read(text[body_start:body_end]) or text[at:position])
    end = len(text) if finished else undecided_tail(text, position, (opening,))
    if end > position:
        items.append(text[position:end])
    return Scan(items, end)


def value_json(value: str, as_text: bool) -> str:
    """A value a format writes without its type, as JSON text: as_text, the text as a JSON string;
    else the value as written where it is JSON, the text where it is not."""
    if not as_text:
        stripped = value.strip()
        decoded = decode_json(stripped, 0) if stripped else None
        if decoded is not None and decoded[1] == len(stripped):
            return stripped
    return json.dumps(value, ensure_ascii=False)


def sendable(name: str) -> bool:
    """Whether a call's name can go out as UTF-8 (see _encodable)."""
    return _encodable(name)


def undecided_tail(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Where text[start:] ends in the beginning of a marker (len(text) when it does not): text from
    there on may still become that marker."""
    longest = max(map(len, markers))
    for position in range(max(start, len(text) - longest + 1), len(text)):
        tail = text[position:]
        if any(marker.startswith(tail) for marker in markers):
            return position
    return len(text)


def decode_json(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value that starts at text[start] and the position after it, or None when there is
    none there (yet)."""
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):  # not JSON; or an integer past Python's 4,300 digits, or deep nesting
        return None


def arguments_text(text: str) -> str | None:
    """`text` stripped, when it is a JSON object (the arguments as the model wrote them)."""
    text = text.strip()
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # as decode_json
        return None
    return text if isinstance(value, dict) and _encodable(text) else None


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def member_spans(text: str, start: int) -> dict[str, tuple[int, int]] | list[tuple[int, int]]:
    """Where each top-level member of the JSON object or array at text[start] (valid JSON, as
    decode_json found it) is written: {key: (start, end)} for an object (a repeated key: its last
    value, as json.loads keeps), [(start, end), ...] for an array."""
    is_object = text[start] == "{"
    members: dict[str, tuple[int, int]] | list[tuple[int, int]] = {} if is_object else []
    position = _JSON_SPACE.match(text, start + 1).end()
    while text[position] not in "}]":
        if is_object:
            key, position = _DECODER.raw_decode(text, position)
            position = _JSON_SPACE.match(text, _JSON_SPACE.match(text, position).end() + 1).end()  # past ':'
        _, end = _DECODER.raw_decode(text, position)
        if is_object:
            members[key] = (position, end)
        else:
            members.append((position, end))
        position = _JSON_SPACE.match(text, end).end()
        if text[position] == ",":
            position = _JSON_SPACE.match(text, position + 1).end()
    return members


def _encodable(text: str) -> bool:
    """Whether `text` can be sent as UTF-8 (a JSON escape such as \\ud800 decodes to a lone
    surrogate, which cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def calls_at(text: str, start: int) -> tuple[list[ToolCall | None] | ToolCall | None, int] | None:
    """The JSON value written at text[start] read as a call ({"name": ..., "arguments" (or
    "parameters"): {...}}: a ToolCall, None when the value is not one) or as an array of calls (a
    list of ToolCall-or-None), and the position after it; None when no JSON value is complete
    there. Arguments written as an object are kept exactly as the model wrote them (numbers,
    escapes, spacing); written as a string, it must hold a JSON object."""
    decoded = decode_json(text, start)
    if decoded is None:
        return None
    value, end = decoded
    if isinstance(value, list):
        return [_call(item, text, span[0]) for item, span in zip(value, member_spans(text, start))], end
    return _call(value, text, start), end


def _call(value: Any, text: str, start: int) -> ToolCall | None:
    """The call whose JSON, written at text[start], decodes to `value` (see calls_at)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"] \
            or not _encodable(value["name"]):
        return None
    key = "arguments" if "arguments" in value else "parameters" if "parameters" in value else None
    if key is None:
        return ToolCall(value["name"], "{}")
    arguments = value[key]
    if isinstance(arguments, dict):
        return ToolCall(value["name"], text[slice(*member_spans(text, start)[key])])
    arguments = arguments_text(arguments) if isinstance(arguments, str) else None
    return ToolCall(value["name"], arguments) if arguments is not None else None
