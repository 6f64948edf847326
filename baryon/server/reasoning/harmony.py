"""The `harmony` reasoning format (GPT-OSS): the reply is a sequence of messages

    [<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT ...]<|message|>BODY(<|end|> | <|return|> | <|call|>)

The `analysis` channel is the reasoning; `final` (and `commentary` addressed to no tool) is the
content. The markers are special tokens, so a server with this parser decodes replies with
special tokens kept. A reply without any channel marker is all content.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

_CHANNEL, _MESSAGE = "<|channel|>", "<|message|>"
_BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_MARKERS = ("<|start|>", _CHANNEL, _MESSAGE, "<|constrain|>", *_BODY_ENDS)


def _complete_prefix(text: str) -> str:
    """text without a trailing start of a marker (`<|chan` of a marker still being generated)."""
    longest = max(map(len, _MARKERS))
    for start in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[start:]
        if any(marker.startswith(tail) for marker in _MARKERS):
            return text[:start]
    return text


def _messages(text: str, position: int) -> Iterator[tuple[int, str | None, int, int, bool]]:
    """From `position` on: (where the message's <|channel|> is, "reasoning_content", "content" or
    None (a tool call), body start, body end, whether the body has ended) of each message whose
    header is complete."""
    while (channel := text.find(_CHANNEL, position)) >= 0:
        message = text.find(_MESSAGE, channel)
        if message < 0:
            return
        header = text[channel + len(_CHANNEL):message].split()
        start = message + len(_MESSAGE)
        ends = [i for i in (text.find(marker, start) for marker in _BODY_ENDS) if i >= 0]
        end = min(ends, default=len(text))
        name = header[0] if header else ""
        # The recipient may stand after the channel or before it, in the message's start header
        # (`<|start|>assistant to=functions.f<|channel|>`).
        opened = text.rfind("<|start|>", 0, channel)
        before = text[opened:channel].split() if opened >= 0 and not any(
            text.find(marker, opened, channel) >= 0 for marker in _BODY_ENDS) else []
        addressed = any(h.startswith("to=") for h in header + before)
        part = None
        if name == "analysis":
            part = "reasoning_content"
        elif name == "final" or (name == "commentary" and not addressed):
            part = "content"
        yield channel, part, start, end, bool(ends)
        position = end


def _is_plain(text: str) -> bool:
    return _CHANNEL not in text and _MESSAGE not in text


def split_harmony(text: str, finished: bool) -> tuple[str, str]:
    """(reasoning, content) of a harmony reply so far. While it is being generated, a message
    header not yet closed by <|message|> and a partial marker at the end are left out, so each
    call's result extends the previous one's."""
    if not finished:
        text = _complete_prefix(text)
    if _is_plain(text):
        return "", text
    parts: dict[str | None, list[str]] = {"reasoning_content": [], "content": [], None: []}
    for _, part, start, end, _ in _messages(text, 0):
        parts[part].append(text[start:end])
    return "".join(parts["reasoning_content"]), "".join(parts["content"])


@dataclass
class ReasoningCursor:
    """Where a streamed choice is: the first message whose body has not ended (its <|channel|> in
    the text) and how much of that body was sent. Each call reads only from there, so a long
    reply costs a stream time proportional to its length, not its square."""

    position: int = 0
    sent: int = 0

    def advance(self, text: str, finished: bool) -> dict[str, str]:
        """The delta fields ({"reasoning_content": ..., "content": ...}, those with new text)."""
        if not finished:
            text = _complete_prefix(text)
        if self.position == 0 and _is_plain(text):  # no message yet: plain text is content
            delta = {"content": text[self.sent:]} if len(text) > self.sent else {}
            self.sent = max(self.sent, len(text))
            return delta
        delta: dict[str, str] = {}
        for channel, part, start, end, ended in _messages(text, self.position):
            if channel != self.position:  # a new message: nothing of it sent yet
                self.position, self.sent = channel, 0
            if part is not None and end - start > self.sent:
                delta[part] = delta.get(part, "") + text[start + self.sent:end]
            self.sent = max(self.sent, end - start)
            if ended:
                self.position, self.sent = end, 0
        return delta
