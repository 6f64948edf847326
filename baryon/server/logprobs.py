"""Logprobs in OpenAI's two shapes, from the engine's per-position dicts (token id -> Logprob).

Completions: {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}.
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
`top_logprobs` holds the k most likely tokens of the position (the chosen one only if it is
among them). Without a tokenizer a token's text is "token_id:<id>".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baryon.outputs import PositionLogprobs
from baryon.tokenizer import token_bytes, token_texts


def token_text(token_id: int, entry: PositionLogprobs | None, tokenizer: Any | None) -> str:
    logprob = entry.get(token_id) if entry else None
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    if tokenizer is not None:
        return token_texts(tokenizer)(token_id)
    return f"token_id:{token_id}"


# What a logprob of -inf (a token a grammar or a penalty ruled out) is reported as: JSON has no
# infinity, and null would read as "no logprob"; vLLM reports the same floor.
LOGPROB_FLOOR = -9999.0


def reported(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def top_alternatives(entry: PositionLogprobs, top_n: int) -> list[tuple[int, float]]:
    """The top_n most likely (token id, logprob) of a position, most likely first."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [(token_id, reported(lp.logprob)) for token_id, lp in ranked if lp.rank <= top_n]


@dataclass
class CompletionLogprobs:
    """Builds completion logprobs chunk by chunk (text_offset continues across chunks)."""

    top_n: int
    tokenizer: Any | None
    offset: int = 0  # text offset of the next token

    def build(self, token_ids: list[int], entries: list[PositionLogprobs | None],
              echoed: tuple[str, int] | None = None) -> dict[str, list]:
        """echoed: (the text shown for an echoed prompt, its token count) when the first tokens are
        that prompt's: their offsets point into the text as shown (see _EchoCursor), and the
        tokens after them start at its end."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        cursor = _EchoCursor(echoed[0]) if echoed is not None else None
        for position, (token_id, entry) in enumerate(zip(token_ids, entries)):
            text = token_text(token_id, entry, self.tokenizer)
            chosen = entry.get(token_id) if entry else None
            tokens.append(text)
            token_logprobs.append(None if chosen is None else reported(chosen.logprob))
            top_logprobs.append(None if entry is None else {
                token_text(alt, entry, self.tokenizer): value for alt, value in top_alternatives(entry, self.top_n)})
            if cursor is not None and position < echoed[1]:
                text_offset.append(self.offset + cursor.advance(token_bytes(self.tokenizer, token_id, text)))
                if position == echoed[1] - 1:
                    self.offset += len(echoed[0])  # the generated text follows the echoed prompt
            else:
                text_offset.append(self.offset)
                self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


class _EchoCursor:
    """Walks an echoed prompt's text by its tokens' bytes: a token's offset is the character its
    first byte falls in (the bytes of a character split over byte tokens all point at it); a
    token the text does not show (the BOS a tokenizer added) takes no width, nor the space a
    SentencePiece tokenizer reads before the first word."""

    def __init__(self, shown: str) -> None:
        self.shown = shown.encode("utf-8")
        self.char_at = [0] * (len(self.shown) + 1)  # byte position -> the character it falls in
        at = 0
        for index, char in enumerate(shown):
            width = len(char.encode("utf-8"))
            self.char_at[at:at + width] = [index] * width
            at += width
        self.char_at[at] = len(shown)
        self.at = 0  # bytes of the shown text consumed

    def advance(self, piece: bytes) -> int:
        """The offset (in characters) of a token of these bytes, moving past them where shown."""
        offset = self.char_at[self.at]
        if self.shown.startswith(piece, self.at):
            self.at += len(piece)
        elif piece[:1] == b" " and self.shown.startswith(piece[1:], self.at):
            self.at += len(piece) - 1
        return offset


def chat_logprobs(token_ids: list[int], entries: list[PositionLogprobs], top_n: int, tokenizer: Any | None) -> dict:
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(token_id, entry, tokenizer)
        alternatives = []
        for alt, value in top_alternatives(entry, top_n):
            alt_text = token_text(alt, entry, tokenizer)
            alternatives.append({"token": alt_text, "logprob": value,
                                 "bytes": list(token_bytes(tokenizer, alt, alt_text))})
        content.append({"token": text, "logprob": reported(entry[token_id].logprob),
                        "bytes": list(token_bytes(tokenizer, token_id, text)), "top_logprobs": alternatives})
    return {"content": content}
