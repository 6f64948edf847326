"""`llama3_json` (Llama 3.1 / 3.2 JSON tool calling): the reply is the calls,

    [<|python_tag|>]{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

("arguments" is accepted for "parameters"). A reply that does not start with `{` or the tag is
plain content; from a JSON value that is not a call on, the rest of the reply is content.
"""

from __future__ import annotations

import re

from baryon.server.tool_parsers.base import Scan, ToolCall, ToolParser, calls_at

_PYTHON_TAG = "<|python_tag|>"
_SPACE = re.compile(r"\s*")


def _calls_start(text: str) -> int | None:
    """Where the calls begin (after leading space and the tag), -1 for a plain reply, None while
    the start of the reply cannot tell yet."""
    first = _SPACE.match(text).end()
    if text.startswith(_PYTHON_TAG, first):
        return first + len(_PYTHON_TAG)
    if text.startswith("{", first):
        return first
    if _PYTHON_TAG.startswith(text[first:first + len(_PYTHON_TAG)]):  # nothing yet, or part of the tag
        return None
    return -1


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, start: int, finished: bool) -> Scan:
        calls_start = _calls_start(text)
        if calls_start is None and not finished:
            return Scan([], start)
        if calls_start is None or calls_start < 0:  # plain content
            return Scan([text[start:]] if len(text) > start else [], len(text))
        items: list[str | ToolCall] = []
        position = max(start, calls_start)  # where the calls begin, or just after one
        while True:
            value_start = _SPACE.match(text, position).end()
            if position > calls_start and value_start < len(text):  # after a call: "; " or content
                if text[value_start] != ";":
                    return Scan(items, position, text[position:])
                value_start = _SPACE.match(text, value_start + 1).end()
            if value_start == len(text):  # only separators so far
                return Scan(items, len(text) if finished else position)
            found = calls_at(text, value_start)
            call = found[0] if found is not None and not isinstance(found[0], list) else None
            if call is None:  # the rest is content, once it is known not to be a call
                if found is None and not finished:
                    return Scan(items, position)
                return Scan(items, position, text[position:])
            items.append(call)
            position = found[1]
