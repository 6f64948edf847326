"""`deepseek_v3` (DeepSeek-V3, also V3.1's shorter form): text (content), then the calls

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(V3.1: `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`). The
markers are the tokenizer's, with fullwidth ｜ and ▁. The section markers around the calls are
dropped; a call that cannot be read stays in the content as written.
"""

from __future__ import annotations

from baryon.server.tool_parsers.base import Scan, ToolCall, ToolParser, arguments_text, scan_markers

_CALLS_BEGIN, _CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, _CALL_END, _SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
V3_MARKERS = (_CALLS_BEGIN, _CALLS_END, CALL_BEGIN)  # what opens a call or a section


def _call_in(body: str) -> ToolCall | None:
    """TYPE<sep>NAME\\n```json\\nARGS\\n``` (V3) or NAME<sep>ARGS (V3.1)."""
    head, sep, rest = body.partition(_SEP)
    if not sep:
        return None
    if head.strip() == "function" and not rest.lstrip().startswith("{"):
        name, _, fenced = rest.partition("\n")
        fenced = fenced.strip()
        if fenced.startswith("```") and fenced.endswith("```") and len(fenced) >= 6:
            fenced = fenced[3:-3].removeprefix("json")
        head, rest = name, fenced
    name, arguments = head.strip(), arguments_text(rest)
    if not name or any(c.isspace() for c in name) or arguments is None:
        return None
    return ToolCall(name, arguments)


def read_call_at(text: str, at: int, finished: bool) -> tuple[ToolCall | str, int] | None:
    """The call whose CALL_BEGIN is at text[at] (or, unreadable, its text as content) and the
    position after it; None while it is still being written."""
    position = at + len(CALL_BEGIN)
    ends = [end for end in (text.find(_CALL_END, position), text.find(_CALLS_END, position)) if end >= 0]
    if not ends and not finished:
        return None
    body_end = min(ends, default=len(text))
    after = body_end + len(_CALL_END) if text.startswith(_CALL_END, body_end) else body_end
    return _call_in(text[position:body_end]) or text[at:after], after


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def scan(self, text: str, start: int, finished: bool) -> Scan:
        def read(marker: str, at: int):
            if marker != CALL_BEGIN:  # a section marker: structure, not content
                return None, at + len(marker)
            return read_call_at(text, at, finished)

        return scan_markers(text, start, finished, V3_MARKERS, read)
