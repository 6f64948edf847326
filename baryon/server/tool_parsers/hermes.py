"""`hermes` (Qwen2.5, Qwen3, Hermes): each call between tags, its body a JSON object

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or, as Qwen3-Coder writes it (model type qwen3_moe too), a function with one tag per parameter

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

whose values are written untyped: one the tool's schema declares a string is that text (less the
newline after the opening tag and before the closing one); any other is read as JSON where it is
JSON, else as text. Calls come in a row or among text, which is content. A call whose body is
neither stays in the content as written; so does an unclosed one at the end, unless its body is a
whole call.
"""

from __future__ import annotations

import json
import re

from baryon.server.tool_parsers.base import Scan, ToolCall, ToolParser, calls_at, scan_tagged, sendable, value_json

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>]*)>(.*)</function>\s*\Z", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"

    def _call_in(self, body: str) -> ToolCall | None:
        """The call a tag's body holds whole, else None."""
        if body.lstrip(" \t\n\r").startswith("<function="):
            return self._function_call_in(body)
        start = len(body) - len(body.lstrip(" \t\n\r"))
        found = calls_at(body, start)
        if found is None or isinstance(found[0], list) or body[found[1]:].strip(" \t\n\r"):
            return None
        return found[0]

    def _function_call_in(self, body: str) -> ToolCall | None:
        """Qwen3-Coder's <function=NAME> with <parameter=KEY> tags, white space between."""
        match = _FUNCTION.match(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        if not name or not sendable(name):
            return None
        members, position = [], 0
        while parameter := _PARAMETER.match(inner, position):
            key, value = parameter.group(1).strip(), parameter.group(2)
            value = value.removeprefix("\n").removesuffix("\n")
            as_text = self.declared_type(name, key) == "string"
            members.append(f"{json.dumps(key, ensure_ascii=False)}: {value_json(value, as_text)}")
            position = parameter.end()
        if inner[position:].strip():
            return None
        return ToolCall(name, "{" + ", ".join(members) + "}")

    def scan(self, text: str, start: int, finished: bool) -> Scan:
        return scan_tagged(text, start, finished, _OPEN, _CLOSE, self._call_in)
