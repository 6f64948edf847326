"""`glm45` (GLM-4.5 / 4.6, model type glm4_moe): each call between tags, its name on the first
line, then its arguments as key / value tags,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

in a row or among text, which is content. A value is written without its type: one the tool's
schema declares a string is that text; any other value is read as JSON where it is JSON (kept as
written), else as text, as vLLM's parser reads it. The arguments are one JSON object in the order
written. A call that cannot be read stays in the content as written (also one cut off at the end).
"""

from __future__ import annotations

import json
import re

from baryon.server.tool_parsers.base import Scan, ToolCall, ToolParser, scan_tagged, sendable, value_json

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45ToolParser(ToolParser):
    name = "glm45"

    def _call_in(self, body: str) -> ToolCall | None:
        """NAME, then <arg_key>/<arg_value> pairs, white space between."""
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        if not name or any(c.isspace() or c in "<>" for c in name):
            return None
        members, position = [], 0 if first < 0 else first
        while match := _ARGUMENT.match(body, position):
            key, value = match.group(1).strip(), match.group(2)
            as_text = self.declared_type(name, key) == "string"
            members.append(f"{json.dumps(key, ensure_ascii=False)}: {value_json(value, as_text)}")
            position = match.end()
        if first >= 0 and body[position:].strip() or not sendable(name):  # not an argument; or the name
            return None
        return ToolCall(name, "{" + ", ".join(members) + "}")

    def scan(self, text: str, start: int, finished: bool) -> Scan:
        return scan_tagged(text, start, finished, _OPEN, _CLOSE, self._call_in)
