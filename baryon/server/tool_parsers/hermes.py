"""`hermes` (Qwen2.5, Qwen3, Hermes): each call is a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in a row or among text, which is content. A call whose body is not such an object stays in the
content as written; so does an unclosed one at the end, unless its body is a whole call.
"""

from __future__ import annotations

from baryon.server.tool_parsers.base import Scan, ToolCall, ToolParser, calls_at, undecided_tail

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
        items: list[str | ToolCall] = []
        position = start
        while (opening := text.find(_OPEN, position)) >= 0:
            if opening > position:
                items.append(text[position:opening])
            body_start = opening + len(_OPEN)
            closing = text.find(_CLOSE, body_start)
            if closing < 0 and not finished:  # still being written
                return Scan(items, opening)
            body_end = closing if closing >= 0 else len(text)
            position = body_end + len(_CLOSE) if closing >= 0 else len(text)
            items.append(_call_in(text[body_start:body_end]) or text[opening:position])
        end = len(text) if finished else undecided_tail(text, position, (_OPEN,))
        if end > position:
            items.append(text[position:end])
        return Scan(items, end)
