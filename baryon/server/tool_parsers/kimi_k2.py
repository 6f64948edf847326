"""`kimi_k2` (Moonshot's Kimi-K2, a DeepSeek-V3 model of model_type `kimi_k2`): text (content),
then the calls

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_call_begin|>...<|tool_call_end|><|tool_calls_section_end|>

A call's header `functions.NAME:INDEX` is its id, as Kimi's chat template writes the ids of the
calls it is sent back (and as vLLM's parser keeps them; the calls the server writes for
tool_choice `required` or a named function get ids of that form too); the name is what lies
between the `functions.` prefix and the last `:`, and a header without a name is no call. K2
also writes the section markers in the singular (`<|tool_call_section_begin|>`). The section
markers are dropped; a call that cannot be read
stays in the content as written.
"""

from __future__ import annotations

from baryon.server.tool_parsers.base import Scan, ToolCall, ToolParser, arguments_text, scan_markers, sendable

_SECTION_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>",
                    "<|tool_calls_section_end|>", "<|tool_call_section_end|>")
_CALL_BEGIN, _ARGUMENTS, _CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_OPENERS = (*_SECTION_MARKERS, _CALL_BEGIN)


def _call_in(body: str) -> ToolCall | None:
    """HEADER<|tool_call_argument_begin|>ARGS, HEADER = functions.NAME:INDEX (the id)."""
    header, marker, rest = body.partition(_ARGUMENTS)
    header = header.strip()
    function = header.removeprefix("functions.")
    name = function.rpartition(":")[0] if ":" in function else function
    arguments = arguments_text(rest)
    if not marker or not name or any(c.isspace() for c in header) or not sendable(header) or arguments is None:
        return None
    return ToolCall(name, arguments, id=header)


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"

    @staticmethod
    def call_id(function: str, index: int) -> str:
        return f"functions.{function}:{index}"  # the header Kimi's template writes back

    def scan(self, text: str, start: int, finished: bool) -> Scan:
        def read(marker: str, at: int):
            if marker != _CALL_BEGIN:  # a section marker: structure, not content
                return None, at + len(marker)
            position = at + len(marker)
            ends = [end for end in (text.find(_CALL_END, position),
                                    *(text.find(m, position) for m in _SECTION_MARKERS[2:])) if end >= 0]
            if not ends and not finished:
                return None
            body_end = min(ends, default=len(text))
            after = body_end + len(_CALL_END) if text.startswith(_CALL_END, body_end) else body_end
            return _call_in(text[position:body_end]) or text[at:after], after

        return scan_markers(text, start, finished, _OPENERS, read)
