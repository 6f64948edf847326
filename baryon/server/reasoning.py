"""Reasoning parsers: a chat reply split into `reasoning_content` and `content`.

`harmony` (GPT-OSS): the reply is a sequence of messages

    [<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT ...]<|message|>BODY(<|end|> | <|return|> | <|call|>)

The `analysis` channel is the reasoning; `final` (and `commentary` addressed to no tool) is the
content. The markers are special tokens, so a server with this parser decodes replies with
special tokens kept. A reply without any channel marker is all content.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("harmony",)
_CHANNEL, _MESSAGE = "<|channel|>", "<|message|>"
_BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_MARKERS = ("<|start|>", _CHANNEL, _MESSAGE, "<|constrain|>", *_BODY_ENDS)


def default_reasoning_parser(model_type: str | None) -> str | None:
    """The parser a model's replies need without being asked (GPT-OSS speaks harmony)."""
    return "harmony" if model_type == "gpt_oss" else None


def _complete_prefix(text: str) -> str:
    """text without a trailing start of a marker (`<|chan` of a marker still being generated)."""
    longest = max(map(len, _MARKERS))
    for start in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[start:]
        if any(marker.startswith(tail) for marker in _MARKERS):
            return text[:start]
    return text


def split_harmony(text: str, finished: bool) -> tuple[str, str]:
    """(reasoning, content) of a harmony reply so far. While it is being generated, a message
    header not yet closed by <|message|> and a partial marker at the end are left out, so each
    call's result extends the previous one's."""
    if not finished:
        text = _complete_prefix(text)
    if _CHANNEL not in text and _MESSAGE not in text:
        return "", text
    reasoning, content = [], []
    position = 0
    while (channel := text.find(_CHANNEL, position)) >= 0:
        message = text.find(_MESSAGE, channel)
        if message < 0:
            break
        header = text[channel + len(_CHANNEL):message].split()
        start = message + len(_MESSAGE)
        ends = [i for i in (text.find(marker, start) for marker in _BODY_ENDS) if i >= 0]
        end = min(ends, default=len(text))
        name = header[0] if header else ""
        if name == "analysis":
            reasoning.append(text[start:end])
        elif name == "final" or (name == "commentary" and not any(h.startswith("to=") for h in header)):
            content.append(text[start:end])
        position = end
    return "".join(reasoning), "".join(content)


@dataclass
class ReasoningCursor:
    """What a streamed choice has sent of each part."""

    reasoning_sent: int = 0
    content_sent: int = 0

    def advance(self, text: str, finished: bool) -> dict[str, str]:
        """The delta fields ({"reasoning_content": ..., "content": ...}, those with new text)."""
        reasoning, content = split_harmony(text, finished)
        delta = {}
        if len(reasoning) > self.reasoning_sent:
            delta["reasoning_content"] = reasoning[self.reasoning_sent:]
        if len(content) > self.content_sent:
            delta["content"] = content[self.content_sent:]
        self.reasoning_sent, self.content_sent = max(self.reasoning_sent, len(reasoning)), \
            max(self.content_sent, len(content))
        return delta
