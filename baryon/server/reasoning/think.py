"""The `<think>` reasoning format (Qwen3, DeepSeek-R1): the reply is

    [<think>]REASONING</think>CONTENT

Text before `</think>` is the reasoning and text after it the content, each trimmed of the
whitespace next to the markers (`<think>\\n` and `</think>\\n\\n` are how the models write them).
A reply may start inside the reasoning: DeepSeek-R1's chat template (and Qwen3's thinking
templates) put `<think>` in the prompt, so the reply has no `<think>` and everything before a
`</think>` is reasoning, all of it if none comes. A reply that starts outside the reasoning
(`starts_in_reasoning=False`, Qwen3) is thinking only if it opens with `<think>`; otherwise all of
it is content (thinking was switched off) and later markers are plain text, which a stream
could not take back anyway. The markers are added tokens (special or not) or plain text alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

OPEN, CLOSE = "<think>", "</think>"
_SPACE = re.compile(r"\s*")


class _Spans(NamedTuple):
    """Where the parts of a reply so far are: text[reasoning_start:reasoning_end] and
    text[content_start:]; close is where `</think>` is (-1 while there is none)."""

    reasoning_start: int
    reasoning_end: int
    content_start: int
    close: int


def _skip_space(text: str, position: int) -> int:
    return _SPACE.match(text, position).end()


def _trim_end(text: str, start: int, end: int) -> int:
    """end moved back over the whitespace before it (not before start)."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


def _without_partial_close(text: str, start: int) -> int:
    """Where text ends without a trailing start of `</think>` (`</thi` of a marker still being
    generated), not before start."""
    for length in range(min(len(CLOSE) - 1, len(text) - start), 0, -1):
        if text.endswith(CLOSE[:length]):
            return len(text) - length
    return len(text)


def _spans(text: str, finished: bool, starts_in_reasoning: bool, search_from: int = 0) -> _Spans:
    """The parts of a reply so far. While it is being generated, whitespace that may yet turn out
    to border a marker, a partial `</think>` and a reply that may still become `<think>` are left
    out, so each call's parts extend the previous call's. `</think>` is looked for from
    search_from on (a stream passes where the last call stopped looking)."""
    first = _skip_space(text, 0)
    nothing = _Spans(0, 0, len(text), -1)
    if text.startswith(OPEN, first):
        start = first + len(OPEN)
    elif not finished and len(text) - first < len(OPEN) and OPEN.startswith(text[first:]):
        return nothing  # `<thi` or only whitespace yet: reasoning or not is still open
    elif starts_in_reasoning:
        start = first
    else:
        return _Spans(0, 0, 0, -1)  # thinking was off: all content
    close = text.find(CLOSE, max(start, search_from))
    if close >= 0:
        end, content_start = close, _skip_space(text, close + len(CLOSE))
    else:
        end = len(text) if finished else _without_partial_close(text, start)
        content_start = len(text)
    end = _trim_end(text, start, end)
    return _Spans(min(_skip_space(text, start), end), end, content_start, close)


def split_think(text: str, finished: bool, starts_in_reasoning: bool) -> tuple[str, str]:
    """(reasoning, content) of a `<think>` reply so far (see the module's docstring)."""
    spans = _spans(text, finished, starts_in_reasoning)
    return text[spans.reasoning_start:spans.reasoning_end], text[spans.content_start:]


@dataclass
class ThinkCursor:
    """How much of a streamed choice's reasoning and content was sent (positions in its text) and
    where to look for `</think>`, so a long reply costs a stream time proportional to its length."""

    starts_in_reasoning: bool
    reasoning_sent: int = 0
    content_sent: int = 0
    search_from: int = 0

    def advance(self, text: str, finished: bool) -> dict[str, str]:
        """The delta fields ({"reasoning_content": ..., "content": ...}, those with new text)."""
        spans = _spans(text, finished, self.starts_in_reasoning, self.search_from)
        delta: dict[str, str] = {}
        start = max(spans.reasoning_start, self.reasoning_sent)
        if spans.reasoning_end > start:
            delta["reasoning_content"] = text[start:spans.reasoning_end]
            self.reasoning_sent = spans.reasoning_end
        start = max(spans.content_start, self.content_sent)
        if len(text) > start:
            delta["content"] = text[start:]
            self.content_sent = len(text)
        self.search_from = spans.close if spans.close >= 0 else max(0, len(text) - len(CLOSE) + 1)
        return delta
