"""`openai` (alias `harmony`; GPT-OSS): the reply is a sequence of messages

    [<|start|>ROLE][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY END

ended by <|end|>, <|return|>, <|call|> (or the next <|start|>). A message addressed to
`functions.NAME` is a call of NAME with the body as its arguments; the `analysis` channel is
reasoning (the reasoning parser's), left out here, as are messages to other (built-in) tools on it;
any other message is content. A call whose body is not a JSON object stays in the content. A reply
that does not start like a message is all content.
"""

from __future__ import annotations

import re

from baryon.server.tool_parsers.base import Scan, ToolCall, ToolParser, arguments_text, undecided_tail

_START, _MESSAGE = "<|start|>", "<|message|>"
_BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", _START)  # <|start|> is the next message's
_BODY_END = re.compile("|".join(map(re.escape, _BODY_ENDS)))
_SPACE = re.compile(r"\s*")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")
_FUNCTIONS = "functions."


def _is_harmony(text: str) -> bool | None:
    """Whether the reply starts like a message (`<|...` or `to=`); None while it cannot tell."""
    first = _SPACE.match(text).end()
    head = text[first:first + 3]
    if head.startswith(("<|", "to=")):
        return True
    return None if "<|".startswith(head) or "to=".startswith(head) else False


def _body_end(text: str, body_start: int) -> tuple[int, int]:
    """Where the body starting at `body_start` ends and where the next message starts; (-1, -1)
    while it has not ended."""
    end = _BODY_END.search(text, body_start)
    if end is None:
        return -1, -1
    return end.start(), end.start() if end.group() == _START else end.end()


def _function(header: str) -> str | None:
    """The function a message is addressed to (after `to=functions.`), or None."""
    recipient = _RECIPIENT.search(header)
    if recipient and recipient.group(1).startswith(_FUNCTIONS):
        return recipient.group(1)[len(_FUNCTIONS):]
    return None


def _is_reasoning(header: str) -> bool:
    channel = _CHANNEL.search(header)
    return bool(channel) and channel.group(1) == "analysis"


def _call(function: str, body: str) -> ToolCall | str:
    arguments = arguments_text(body)
    return ToolCall(function, arguments) if function and arguments is not None else body


class HarmonyToolParser(ToolParser):
    name = "openai"
    reads_whole_reply = True

    def scan(self, text: str, start: int, finished: bool) -> Scan:
        harmony = _is_harmony(text)
        if not harmony:  # plain content, or (None) too early to tell
            if harmony is None and not finished:
                return Scan([], start)
            return Scan([text[start:]] if len(text) > start else [], len(text))
        items: list[str | ToolCall] = []
        position = start  # where a message starts
        while (message := text.find(_MESSAGE, position)) >= 0:
            header, body_start = text[position:message], message + len(_MESSAGE)
            body_end, next_start = _body_end(text, body_start)
            function = _function(header)
            is_content = function is None and not _is_reasoning(header)
            if body_end < 0 and not finished:  # the body is still being written
                if is_content:  # what of it is decided
                    return Scan(items, position, text[body_start:undecided_tail(text, body_start, _BODY_ENDS)])
                return Scan(items, position)
            if body_end < 0:
                body_end = next_start = len(text)
            body = text[body_start:body_end]
            if function is not None:
                items.append(_call(function, body))
            elif is_content and body:
                items.append(body)
            position = next_start
        return Scan(items, len(text) if finished else position)  # a trailing header is structure
