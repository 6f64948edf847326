"""`hermes` (Qwen2.5, Qwen3, Hermes): each call is a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in a row or among text, which is content. A call whose body is not such an object stays in the
content as written; so does an unclosed one at the end, unless its body is a whole call.
"""

from __future__ import annotations

from baryon.server.tool_parsers.base import Scan, ToolCall, ToolParser, calls_at, scan_tagged

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _call_in(body: str) -> ToolCall | None:
    """The call a tag's body holds whole (JSON white space around it), else None."""
    start = len(body) - len(body.lstrip(" \t\n\r"))
    found = calls_at(body, start)
    if found is None or isinstance(found[0], list) or body[found[1]:].strip(" \t\n\r"):
        return None
    return found[0]


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, start: int, finished: bool) -> Scan:
        return scan_tagged(text, start, finished, _OPEN, _CLOSE, _call_in)
