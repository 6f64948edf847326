"""`mistral`: text (content), then calls after a `[TOOL_CALLS]` marker, in either form

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]    (older tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}   (v11 and later)

(v13 writes `NAME[CALL_ID]ID[ARGS]`; the id is not kept). A call that cannot be read stays in the
content as written, up to the next marker. Call ids are nine letters and digits, what Mistral's
chat templates accept when a conversation with the calls comes back (they refuse others).
"""

from __future__ import annotations

import re
import secrets
import string

from baryon.server.tool_parsers.base import Scan, ToolCall, ToolParser, calls_at, decode_json, undecided_tail

_CALLS, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_SPACE = re.compile(r"\s*")
_NAME = re.compile(r"[\w.\-]+")


def mistral_call_id() -> str:
    """Nine random letters and digits (Mistral's templates check tool call ids for exactly that)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _array_calls(calls: object) -> list[ToolCall] | None:
    """calls_at's reading of an array, when it is a non-empty array of calls only."""
    return calls if isinstance(calls, list) and calls and None not in calls else None


def _named_call(region: str, name_start: int, closed: bool) -> tuple[ToolCall | None, int] | None:
    """The call NAME[ARGS]{...} at `name_start` and the position after it; (None, end) when what
    lies there is not one; None while it is still being written."""
    args_marker = region.find(_ARGS, name_start)
    if args_marker < 0:
        return (None, len(region)) if closed else None
    name = region[name_start:args_marker].partition(_CALL_ID)[0].strip()
    args_start = _SPACE.match(region, args_marker + len(_ARGS)).end()
    decoded = decode_json(region, args_start)
    if decoded is None:
        return (None, len(region)) if closed else None
    if not _NAME.fullmatch(name) or not isinstance(decoded[0], dict):
        return None, decoded[1]
    return ToolCall(name, region[args_start:decoded[1]]), decoded[1]


def _read_calls(text: str, marker: int, finished: bool) -> tuple[list[ToolCall] | None, int] | None:
    """The calls after the marker at `marker` and the position after them; (None, end) when they
    cannot be read; None while they are still being written. They end before the next marker."""
    after = _SPACE.match(text, marker + len(_CALLS)).end()
    next_marker = text.find(_CALLS, after)
    region = text if next_marker < 0 else text[:next_marker]
    closed = finished or next_marker >= 0  # no more text can join the region
    if after == len(region):
        return (None, len(region)) if closed else None
    if region[after] != "[":
        named = _named_call(region, after, closed)
        return None if named is None else ([named[0]] if named[0] else None, named[1])
    found = calls_at(region, after)
    if found is None:
        return (None, len(region)) if closed else None
    return _array_calls(found[0]), found[1]


class MistralToolParser(ToolParser):
    name = "mistral"

    @staticmethod
    def call_id(function: str, index: int) -> str:
        return mistral_call_id()

    def scan(self, text: str, start: int, finished: bool) -> Scan:
        items: list[str | ToolCall] = []
        position = start
        while (marker := text.find(_CALLS, position)) >= 0:
            if marker > position:
                items.append(text[position:marker])
            read = _read_calls(text, marker, finished)
            if read is None:  # still being written
                return Scan(items, marker)
            calls, position = read
            for call in calls or []:
                call.id = mistral_call_id()
            items.extend(calls or [text[marker:position]])
        end = len(text) if finished else undecided_tail(text, position, (_CALLS,))
        if end > position:
            items.append(text[position:end])
        return Scan(items, end)
