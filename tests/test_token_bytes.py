"""Each token's bytes (`baryon.tokenizer.token_bytes`, the `bytes` of chat logprobs): joined over a
text's tokens they are the text's UTF-8, also where a character is split over several tokens
(SentencePiece byte fallback, stories260K; byte-level BPE, a tokenizer built here), whose texts
alone read U+FFFD."""

from __future__ import annotations

import random

import pytest

from baryon.tokenizer import token_bytes, token_texts

TEXTS = ["日本語", "Grüße, Zürich 🌧!", "plain words", "ü🌧 x 語"]


@pytest.fixture(scope="module")
def sentencepiece(stories_path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(stories_path)


@pytest.fixture(scope="module")
def byte_level():
    """A byte-level BPE (GPT-2's alphabet, as Qwen's and Llama 3's) trained on a few words."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["plain words and more words", "Zürich"] * 20, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("which", ["sentencepiece", "byte_level"])
def test_token_bytes_join_into_the_text(request, which, seed):
    tokenizer = request.getfixturevalue(which)
    texts = token_texts(tokenizer)
    rng = random.Random(seed)
    for text in TEXTS + ["".join(rng.choice("aü語🌧 .") for _ in range(12))]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        joined = b"".join(token_bytes(tokenizer, i, texts(i)) for i in ids)
        assert joined.decode("utf-8").strip() == text.strip(), (which, text)
    split = [i for i in tokenizer.encode("語", add_special_tokens=False) if "\ufffd" in texts(i)]
    assert split, "the character should be split over byte tokens here"
    assert all(b"\xef\xbf\xbd" not in token_bytes(tokenizer, i, texts(i)) for i in split)
