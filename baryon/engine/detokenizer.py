"""Incremental detokenization: new token ids -> the new text, correct across multi-byte characters.

With a tokenizers-backed tokenizer (all fast tokenizers) this is `tokenizers.decoders.DecodeStream`,
primed with the end of the prompt so the first output token gets its leading space right. Other
tokenizers decode a sliding window of ids and emit the text past the window's previous end,
holding back text that ends in an incomplete character.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens used as left context (enough for any merge or leading-space rule).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._backend = getattr(tokenizer, "_tokenizer", None)
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        else:
            self._ids = context
            self._prefix_offset, self._read_offset = 0, len(context)

    def step(self, token_id: int) -> str:
        """The text that token_id completes ('' while a character is still incomplete)."""
        if self._backend is not None:
            return self._stream.step(self._backend, token_id) or ""
        return self._window_step(token_id)

    def _window_step(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip_special_tokens)
        after = decode(self._ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return after[len(before):]
