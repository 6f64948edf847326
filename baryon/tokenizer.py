"""Tokenizer loading and the end-of-sequence ids of a checkpoint (a folder or a GGUF file)."""

from __future__ import annotations

import functools
import os
import re
import weakref
from typing import Any

from baryon.hub import is_gguf
from baryon.logger import get_logger

logger = get_logger(__name__)


def load_tokenizer(path: str, trust_remote_code: bool) -> Any:
    """The tokenizer of a folder / repo snapshot, or the one a GGUF file's metadata describes
    (vocabulary, merges, special tokens and chat template, converted by transformers)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if is_gguf(path):
            # The fast-tokenizer class directly: AutoTokenizer would first rebuild the model config
            # from the file, parsing its whole vocabulary a second time (~10 s instead of ~1 s).
            folder, name = os.path.split(path)
            return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError, NotImplementedError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r} ({e}); pass tokenizer=... or, to give "
                         f"token ids only, skip_tokenizer_init=True") from e


def eos_token_ids(model_path: str, hf_config: Any, tokenizer: Any | None) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's EOS and generation_config.json's eos_token_id
    (an int or a list), falling back to config.json's (for a GGUF file: its end-of-sequence,
    end-of-turn and end-of-message ids)."""
    from transformers import GenerationConfig

    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    try:
        if not is_gguf(model_path):
            add(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:
        pass  # no generation_config.json
    if not ids:
        add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)


def unpaired_surrogate(text: str) -> int | None:
    """Where `text` holds half a UTF-16 surrogate pair (JSON may escape one: "\\ud800"), which no
    tokenizer or UTF-8 encoder takes; None for valid Unicode."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


class TokenTexts:
    """Each token's text as it reads inside a text, cached. Decoded alone, a SentencePiece token
    loses its leading space ("▁there" is "there" at the start of a text and " there" after another
    token), which made the tokens of a reply not add up to its text (nor text_offset point into
    it): a token is decoded after an anchor token and the anchor's text cut off."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        anchor = tokenizer.encode("a", add_special_tokens=False)
        self.anchor = anchor[-1:] if anchor else []
        self.anchor_text = self._decode(self.anchor)
        self.texts: dict[int, str] = {}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def __call__(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            both = self._decode(self.anchor + [token_id])
            text = both[len(self.anchor_text):] if both.startswith(self.anchor_text) else self._decode([token_id])
            self.texts[token_id] = text
        return text


_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its TokenTexts
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in of each byte (GPT-2's, which Qwen and Llama 3 use) -> the byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The bytes a token stands for, given its text (TokenTexts): the text's UTF-8, except for a
    token holding part of a character, whose text decodes to U+FFFD: then the raw bytes of its
    piece (SentencePiece's <0xE6>, or byte-level BPE's stand-in characters), as OpenAI's
    logprobs `bytes` carry them so that a client can join them into the character."""
    if "\ufffd" not in text or tokenizer is None:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return text.encode("utf-8")
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if piece and all(char in alphabet for char in piece):
        return bytes(alphabet[char] for char in piece)
    return text.encode("utf-8")


def token_texts(tokenizer: Any) -> TokenTexts:
    """The tokenizer's TokenTexts (one per tokenizer, made at the first call)."""
    texts = _TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        texts = _TOKEN_TEXTS[tokenizer] = TokenTexts(tokenizer)
    return texts
