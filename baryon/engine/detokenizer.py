"""Incremental detokenization: new token ids -> the new text, correct across multi-byte characters.

With a tokenizers-backed tokenizer (all fast tokenizers) this is `tokenizers.decoders.DecodeStream`,
primed with the end of the prompt so the first output token gets its leading space right. Other
tokenizers decode a sliding window of ids and emit the text past the window's previous end,
holding back text that ends in an incomplete character. Either way the prompt context is cut at
character boundaries (`split_prompt_tail`), so byte-fallback tokens never straddle it.
"""

from __future__ import annotations

from typing import Any

# Left context taken from the prompt: the shortest clean suffix of at least this many tokens...
_MIN_CONTEXT = 4
# ...and at most this many.
_MAX_CONTEXT = 24
_REPLACEMENT = "\ufffd"


def split_prompt_tail(tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> tuple[list[int], list[int]]:
    """(context, pending) from the end of the prompt. `context` decodes to whole characters (it
    neither starts nor ends inside one), so it can prime the decoder; `pending` holds the last
    prompt tokens of a character the output may complete, whose text then belongs to the output.
    Bytes at the prompt's end that are not one character's beginning (several lone lead bytes,
    say) are in neither."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    tail = list(prompt_token_ids[-_MAX_CONTEXT:])
    end = len(tail)
    while end > 0 and len(tail) - end < 4 and decode(tail[:end]).endswith(_REPLACEMENT):
        end -= 1  # a UTF-8 character spans at most 4 byte tokens
    if decode(tail[:end]).endswith(_REPLACEMENT):
        # Not one split character: bytes the prompt's own text cannot decode. The context stops
        # before them and they are no one's text (a decoder primed with them re-emits the prompt).
        while end > 0 and decode(tail[:end]).endswith(_REPLACEMENT):
            end -= 1
        return _clean_start(decode, tail[:end]), []
    return _clean_start(decode, tail[:end]), tail[end:]


def _clean_start(decode, context: list[int]) -> list[int]:
    """The shortest suffix of `context` of at least _MIN_CONTEXT tokens that does not start inside
    a character (all of it when none)."""
    for start in range(max(0, len(context) - _MIN_CONTEXT), -1, -1):
        if not decode(context[start:]).startswith(_REPLACEMENT):
            return context[start:]
    return context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context, pending = split_prompt_tail(tokenizer, prompt_token_ids, skip_special_tokens)
        self._backend = getattr(tokenizer, "_tokenizer", None)
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
            for token_id in pending:  # an unfinished character: no text yet
                self._stream.step(self._backend, token_id)
        # Every id so far (for the window method, also the stream's fallback).
        self._ids = context + pending
        self._prefix_offset, self._read_offset = 0, len(context)
        # The prompt ends inside a character: until the output's first text, which completes it
        # (the character is then the output's) or does not (its bytes then decode to U+FFFD,
        # which is the prompt's and dropped).
        self._completing = bool(pending)

    def step(self, token_id: int) -> str:
        """The text that token_id completes ('' while a character is still incomplete)."""
        text = self._step(token_id)
        if self._completing and text:
            self._completing = False
            text = text.lstrip(_REPLACEMENT)
        return text

    def _step(self, token_id: int) -> str:
        if self._backend is not None:
            try:
                text = self._stream.step(self._backend, token_id) or ""
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception
                # "Invalid prefix": byte tokens that do not form valid UTF-8 re-decode differently
                # once more tokens follow (random ids do this). The window method copes with it.
                self._to_window()
                return self._window_step(token_id)
            self._ids.append(token_id)
            return text
        return self._window_step(token_id)

    def _to_window(self) -> None:
        self._backend = None
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - _MIN_CONTEXT)

    def _window_step(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip_special_tokens)
        after = decode(self._ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return after[len(before):]
