"""Reasoning parsers: a chat reply split into `reasoning_content` and `content`, whole
(`split_reasoning`) or while it streams (`reasoning_stream(...).advance`).

Each parser name is a format and what the chat template does with it:

    harmony      GPT-OSS messages on channels (harmony.py)
    qwen3        <think>REASONING</think>CONTENT (think.py); a reply that does not open with
                 <think> is all content (thinking switched off)
    deepseek_r1  the same, but the template opens <think> in the prompt, so the reply starts
                 inside the reasoning: without </think> all of it is reasoning

`prompt_ends_in_reasoning=True` says the generation prompt ended inside an open `<think>` (for
example Qwen3's thinking-only templates), which makes qwen3 read replies as deepseek_r1 does.
Markers are special tokens in harmony and added tokens in the others; they are matched as text.
"""

from __future__ import annotations

from typing import Protocol

from baryon.server.reasoning.harmony import ReasoningCursor, split_harmony
from baryon.server.reasoning.think import ThinkCursor, split_think

REASONING_PARSERS = ("harmony", "qwen3", "deepseek_r1")
# The `<think>` parsers, and whether their chat template opens the reasoning in the prompt.
_THINK_STARTS_IN_REASONING = {"qwen3": False, "deepseek_r1": True}

__all__ = ["REASONING_PARSERS", "ReasoningCursor", "ReasoningStream", "ThinkCursor", "default_reasoning_parser",
           "reasoning_stream", "split_harmony", "split_reasoning", "split_think"]


class ReasoningStream(Protocol):
    def advance(self, text: str, finished: bool) -> dict[str, str]:
        """The delta fields ({"reasoning_content": ..., "content": ...}, those with new text) of
        the reply so far (`text` extends the previous call's); all the calls' deltas add up to
        split_reasoning of the whole reply."""


def default_reasoning_parser(model_type: str | None) -> str | None:
    """The parser a model's replies need without being asked (GPT-OSS speaks harmony). Qwen3 and
    DeepSeek-R1 need `--reasoning-parser`: whether a reply thinks depends on the template."""
    return "harmony" if model_type == "gpt_oss" else None


def _starts_in_reasoning(parser: str, prompt_ends_in_reasoning: bool) -> bool | None:
    """Whether a `<think>` parser's reply starts inside the reasoning; None for harmony."""
    if parser == "harmony":
        if prompt_ends_in_reasoning:
            raise ValueError("prompt_ends_in_reasoning is for the <think> parsers; harmony replies say "
                             "their channel themselves")
        return None
    if parser not in _THINK_STARTS_IN_REASONING:
        raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}")
    return _THINK_STARTS_IN_REASONING[parser] or prompt_ends_in_reasoning


def split_reasoning(parser: str, text: str, finished: bool,
                    prompt_ends_in_reasoning: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a reply so far. While it is being generated (not finished), what
    may still turn out to be part of a marker is left out, so each call's parts extend the
    previous call's."""
    starts_in_reasoning = _starts_in_reasoning(parser, prompt_ends_in_reasoning)
    if starts_in_reasoning is None:
        return split_harmony(text, finished)
    return split_think(text, finished, starts_in_reasoning)


def reasoning_stream(parser: str, prompt_ends_in_reasoning: bool = False) -> ReasoningStream:
    """A cursor for one streamed choice: `.advance(text_so_far, finished)` gives the new delta
    fields, reading only the text not read before."""
    starts_in_reasoning = _starts_in_reasoning(parser, prompt_ends_in_reasoning)
    if starts_in_reasoning is None:
        return ReasoningCursor()
    return ThinkCursor(starts_in_reasoning)
