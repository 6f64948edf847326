"""`deepseek_v32` (DeepSeek-V3.2): text (content), then the calls in DeepSeek's markup (DSML),

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

A parameter with string="true" is text as written (sent as a JSON string); string="false" is a
JSON value, kept as written (a value that is not JSON goes as text, as vLLM and SGLang read it).
The arguments are the parameters as one JSON object in their order. The section markers are
dropped (`tool_calls` is read as a section name too); an invoke that cannot be read stays in the
content as written. DeepSeek-V3.2-Exp (the same model type) writes V3.1's calls, which this parser
reads as `deepseek_v3` does.
"""

from __future__ import annotations

import json
import re

from baryon.server.tool_parsers.base import Scan, ToolCall, ToolParser, scan_markers, sendable, value_json
from baryon.server.tool_parsers.deepseek_v3 import CALL_BEGIN, V3_MARKERS, read_call_at

_DSML = "｜DSML｜"
_SECTIONS = tuple(f"<{end}{_DSML}{name}>" for name in ("function_calls", "tool_calls") for end in ("", "/"))
_INVOKE, _INVOKE_END = f"<{_DSML}invoke name=\"", f"</{_DSML}invoke>"
_OPENERS = (*_SECTIONS, _INVOKE, *V3_MARKERS)
_PARAMETER = re.compile(rf'\s*<{_DSML}parameter name="([^"<>]*)"(?: string="(true|false)")?>(.*?)</{_DSML}parameter>',
                        re.DOTALL)


def _invoke(body: str) -> ToolCall | None:
    """NAME">PARAMETERS (what follows `<｜DSML｜invoke name="` up to `</｜DSML｜invoke>`)."""
    name, quote, rest = body.partition('">')
    if not quote or not name or any(c.isspace() or c in "<>\"" for c in name):
        return None
    members, position = [], 0
    while match := _PARAMETER.match(rest, position):
        key, is_string, value = match.groups()
        members.append(f"{json.dumps(key, ensure_ascii=False)}: {value_json(value, is_string == 'true')}")
        position = match.end()
    if rest[position:].strip() or not sendable(name):  # something that is not a parameter; or the name
        return None
    return ToolCall(name, "{" + ", ".join(members) + "}")


class DeepSeekV32ToolParser(ToolParser):
    name = "deepseek_v32"

    def scan(self, text: str, start: int, finished: bool) -> Scan:
        def read(marker: str, at: int):
            if marker == CALL_BEGIN:  # V3.2-Exp's (V3.1's) call
                return read_call_at(text, at, finished)
            if marker != _INVOKE:  # a section marker: structure, not content
                return None, at + len(marker)
            body_start = at + len(marker)
            end = text.find(_INVOKE_END, body_start)
            if end < 0 and not finished:  # still being written
                return None
            if end < 0:  # unclosed at the end: content
                return text[at:], len(text)
            after = end + len(_INVOKE_END)
            return _invoke(text[body_start:end]) or text[at:after], after

        return scan_markers(text, start, finished, _OPENERS, read)
