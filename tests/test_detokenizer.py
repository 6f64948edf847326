"""Incremental detokenization and stop strings against whole-sequence decoding.

The reference for the text of output ids is what the tokenizer decodes for prompt + output, minus
what it decodes for the prompt alone: that is the text the output adds in the context of the
prompt (leading spaces, merges and characters split across byte-fallback tokens included).
Both paths of IncrementalDetokenizer are checked: the tokenizers DecodeStream path (a fast
tokenizer) and the sliding-window fallback (an object exposing only `decode`).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baryon.engine.core import EngineCoreOutput
from baryon.engine.detokenizer import IncrementalDetokenizer
from baryon.engine.output_processor import OutputProcessor
from baryon.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
# A window of the last 6 prompt tokens cuts a character in the regression case below.
CONTEXT_TOKENS = 6

ALPHABET = (list("abcdefghijklmnopqrstuvwxyz") + list("ABCTXZ0123456789") + list("  .,!?'-\n")
            + list("éèêàçñöüßøåÉÖœ€—")  # 2- and 3-byte UTF-8
            + list("你好世界中文字日本語한국어")  # 3-byte CJK / Hangul
            + ["🙂", "🎉", "👍", "🚀", "😀", "🏽", "𝔘"])  # 4-byte
texts = st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=30)


class DecodeOnly:
    """A tokenizer without a `_tokenizer` backend: forces the sliding-window fallback."""

    def __init__(self, tokenizer) -> None:
        self._inner = tokenizer

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._inner.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def hf_tokenizer(stories_path):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(stories_path)
    assert getattr(tok, "_tokenizer", None) is not None  # the DecodeStream path
    return tok


@pytest.fixture(scope="module", params=["decode_stream", "window"])
def tokenizer_pair(request, hf_tokenizer):
    """(tokenizer given to the detokenizer, the HF tokenizer used for the reference)."""
    if request.param == "window":
        return DecodeOnly(hf_tokenizer), hf_tokenizer
    return hf_tokenizer, hf_tokenizer


def decode(tok, ids, skip=True) -> str:
    return tok.decode(list(ids), skip_special_tokens=skip)


def context_cuts_a_character(tok, prompt: list[int], skip: bool) -> bool:
    """The last CONTEXT_TOKENS prompt tokens start inside a multi-byte character (the case a
    naive fixed context window gets wrong; see test_context_window_starting_inside_a_character)."""
    return REPLACEMENT in decode(tok, prompt[-CONTEXT_TOKENS:], skip)


def clean_split_points(tok, ids: list[int], skip: bool) -> list[int]:
    """Prompt lengths (>= 1, leaving >= 1 output token) whose prompt text ends on a whole character.
    """
    return [k for k in range(1, len(ids)) if not decode(tok, ids[:k], skip).endswith(REPLACEMENT)]


def run_detokenizer(detok_tok, ref_tok, prompt: list[int], output: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(detok_tok, prompt, skip_special_tokens=skip)
    base = decode(ref_tok, prompt, skip)
    emitted = released = ""
    deltas = []
    for i, token in enumerate(output):
        delta = detok.step(token)
        assert isinstance(delta, str)
        assert REPLACEMENT not in delta, f"step {i}: delta {delta!r} has U+FFFD"
        emitted += delta
        deltas.append(delta)
        # Text is released as soon as it ends on a whole character, not later: the emitted text is
        # that of the longest output prefix so far that decodes without a dangling partial character.
        full = decode(ref_tok, prompt + output[: i + 1], skip)
        if not full.endswith(REPLACEMENT):
            assert full.startswith(base)
            released = full[len(base):]
        assert emitted == released, f"step {i} (token {token})"
    return deltas


@settings(max_examples=40, deadline=None)
@given(text=texts, extra=st.one_of(st.none(), texts), skip=st.booleans(), data=st.data())
def test_deltas_concatenate_to_the_decoded_output(tokenizer_pair, text, extra, skip, data):
    detok_tok, tok = tokenizer_pair
    ids = tok.encode(text)  # with BOS
    split = data.draw(st.sampled_from(clean_split_points(tok, ids, skip) or [None]), label="split")
    if split is None:
        return
    prompt, output = ids[:split], ids[split:]
    if extra is not None:
        output += tok.encode(extra, add_special_tokens=False)
    # Special tokens in the output: anywhere when they are skipped (even inside a byte-fallback
    # sequence); only between whole characters when they are decoded (else the text is broken).
    for _ in range(data.draw(st.integers(0, 3), label="num_special")):
        positions = [p for p in range(len(output) + 1)
                     if skip or not decode(tok, prompt + output[:p], skip).endswith(REPLACEMENT)]
        pos = data.draw(st.sampled_from(positions), label="pos")
        output.insert(pos, data.draw(st.sampled_from(tok.all_special_ids), label="special"))
    deltas = run_detokenizer(detok_tok, tok, prompt, output, skip)
    full = decode(tok, prompt + output, skip)
    base = decode(tok, prompt, skip)
    assert full.startswith(base)
    assert "".join(deltas) == full[len(base):]


def test_byte_fallback_characters_come_out_whole(tokenizer_pair):
    detok_tok, tok = tokenizer_pair
    prompt = tok.encode("Once upon a time")
    text = " wörld 你好 🙂 ok"
    output = tok.encode(text, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(output)
    assert sum(p.startswith("<0x") for p in pieces) >= 2 + 6 + 4  # ö, 你好 and 🙂 are byte tokens
    deltas = run_detokenizer(detok_tok, tok, prompt, output, True)
    assert "".join(deltas) == decode(tok, prompt + output)[len(decode(tok, prompt)):]
    assert "".join(deltas).endswith("wörld 你好 🙂 ok")
    for char in "ö你好🙂":
        # Exactly one delta carries the character, on the byte token that completes it.
        carriers = [i for i, d in enumerate(deltas) if char in d]
        assert len(carriers) == 1, (char, deltas)
        assert pieces[carriers[0]].startswith("<0x")
        # The bytes before it emitted nothing.
        n_bytes = len(char.encode())
        assert deltas[carriers[0] - n_bytes + 1: carriers[0]] == [""] * (n_bytes - 1)


def test_leading_space_of_first_output_token(tokenizer_pair):
    detok_tok, tok = tokenizer_pair
    prompt = tok.encode("Once upon a")
    output = tok.encode("time there", add_special_tokens=False)  # "▁time" starts with a space piece
    deltas = run_detokenizer(detok_tok, tok, prompt, output, True)
    assert "".join(deltas) == " time there"


def test_prompt_ending_inside_a_character(tokenizer_pair):
    detok_tok, tok = tokenizer_pair
    ids = tok.encode("Hello wörld ok")
    k = next(k for k in range(1, len(ids)) if decode(tok, ids[:k]).endswith(REPLACEMENT))
    detok = IncrementalDetokenizer(detok_tok, ids[:k], skip_special_tokens=True)
    text = "".join(detok.step(t) for t in ids[k:])
    # The completed character belongs to the output (its bytes end there); no prompt text repeats.
    assert text == "örld ok"


@pytest.mark.parametrize("tail", [["<0xC5>", "<0xC6>", "<0xC7>", "<0xC8>", "<0xC9>", "<0xCA>"], ["<0xE9>"],
                                  ["<0xE6>", "<0x97>"], ["<0x97>", "<0xE9>"]])
def test_prompt_ending_in_bytes_no_character_completes(tokenizer_pair, tail):
    """A prompt (token ids) ending in byte tokens the output does not complete into a character:
    lone lead bytes, several of them, a character's first two of three, a stray continuation byte.
    Those bytes are the prompt's: the output's text is its own (no prompt text, no U+FFFD)."""
    detok_tok, tok = tokenizer_pair
    prompt = tok.encode("Once upon") + tok.convert_tokens_to_ids(tail)
    assert decode(tok, prompt).endswith(REPLACEMENT)
    output = tok.encode("no more", add_special_tokens=False)
    detok = IncrementalDetokenizer(detok_tok, prompt, skip_special_tokens=True)
    text = "".join(detok.step(t) for t in output)
    assert text.strip() == "no more" and "upon" not in text, text


@pytest.mark.parametrize("prompt_text, output_text", [("a你好🙂", "你好 ok"), ("0世𝔘", "\n你好 ok")])
def test_context_window_starting_inside_a_character(tokenizer_pair, prompt_text, output_text):
    detok_tok, tok = tokenizer_pair
    ids = tok.encode(prompt_text + output_text)
    prompt = tok.encode(prompt_text)
    assert ids[: len(prompt)] == prompt
    assert context_cuts_a_character(tok, prompt, True)
    detok = IncrementalDetokenizer(detok_tok, prompt, skip_special_tokens=True)
    deltas = [detok.step(t) for t in ids[len(prompt):]]
    assert "".join(deltas) == output_text, deltas


# -- stop strings and n > 1 through the OutputProcessor ----------------------------------------------

def token_texts(tok, prompt: list[int], output: list[int]) -> list[str]:
    """Each output token's delta, from whole-sequence decoding."""
    base = decode(tok, prompt)
    deltas, prev = [], ""
    for i in range(len(output)):
        cur = decode(tok, prompt + output[: i + 1])[len(base):].rstrip(REPLACEMENT)
        deltas.append(cur[len(prev):])
        prev = cur
    return deltas


def feed(processor: OutputProcessor, core_id: str, tokens: list[int], finish_last: str | None = None):
    """Feed tokens one step at a time; returns [(RequestOutput list, abort list)] per step."""
    results = []
    for i, token in enumerate(tokens):
        finish = finish_last if i == len(tokens) - 1 else None
        results.append(processor.process([EngineCoreOutput(core_id, [token], finish_reason=finish)]))
    return results


STORY = "Once upon a time, there was a little cat. The cat was happy. The end. The cat ran."


@pytest.fixture(scope="module")
def story(hf_tokenizer):
    tok = hf_tokenizer
    prompt = tok.encode("Hello")
    output = tok.encode(STORY, add_special_tokens=False)
    return tok, prompt, output, token_texts(tok, prompt, output)


def expected_stop(deltas: list[str], stop: str, min_tokens: int = 0) -> tuple[int, str]:
    """(index of the token that completes the first counted occurrence, text before it)."""
    text = ""
    for i, delta in enumerate(deltas):
        before = len(text)
        text += delta
        if i + 1 < min_tokens:
            continue
        # Occurrences that end inside this token's text.
        pos = text.find(stop, max(0, before - len(stop) + 1))
        if pos >= 0:
            return i, text[:pos]
    raise AssertionError("stop string never completed")


def test_stop_string_cuts_text_and_aborts(story):
    tok, prompt, output, deltas = story
    processor = OutputProcessor(tok)
    core_ids = processor.add_request("req", STORY, prompt, SamplingParams(stop=["The end", "zebra"], max_tokens=100))
    assert core_ids == ["req"]
    stop_at, text = expected_stop(deltas, "The end")
    results = feed(processor, "req", output)
    for i, (outs, aborts) in enumerate(results):
        if i < stop_at:
            assert len(outs) == 1 and not outs[0].finished and aborts == []
            assert outs[0].outputs[0].text == "".join(deltas[: i + 1])
            assert outs[0].outputs[0].finish_reason is None
        elif i == stop_at:
            assert aborts == ["req"]
            (out,) = outs
            assert out.finished
            c = out.outputs[0]
            assert c.text == text  # cut right before "The end"
            assert text.endswith("The cat was happy. ") and "The end" not in text
            assert c.finish_reason == "stop" and c.stop_reason == "The end"
            assert c.token_ids == output[: i + 1]
        else:
            assert outs == [] and aborts == []  # the finished request is forgotten
    assert processor.requests == {} and processor.samples == {}


def test_stop_string_spanning_tokens(story, seed):
    import random

    tok, prompt, output, deltas = story
    rng = random.Random(seed)
    # Stop strings made of the end of one token's text and the start of the next ones'.
    boundaries = [i for i in range(len(deltas) - 1) if deltas[i] and deltas[i + 1]]
    for _ in range(8):
        i = rng.choice(boundaries)
        left = deltas[i][-rng.randint(1, len(deltas[i])):]
        right = deltas[i + 1][: rng.randint(1, len(deltas[i + 1]))]
        stop = left + right
        stop_at, text = expected_stop(deltas, stop)
        full = "".join(deltas)
        assert text == full[: full.find(stop)]
        processor = OutputProcessor(tok)
        processor.add_request("r", None, prompt, SamplingParams(stop=stop, max_tokens=100))
        results = feed(processor, "r", output)
        finished = [j for j, (outs, _) in enumerate(results) if outs and outs[0].finished]
        assert finished == [stop_at], (stop, finished)
        (out,), aborts = results[stop_at]
        assert aborts == ["r"]
        assert out.outputs[0].text == text
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)


def test_stop_string_inside_a_byte_fallback_character(hf_tokenizer):
    tok = hf_tokenizer
    prompt = tok.encode("Hi")
    output = tok.encode("a 你好 b", add_special_tokens=False)
    processor = OutputProcessor(tok)
    processor.add_request("r", None, prompt, SamplingParams(stop="好", max_tokens=50))
    results = feed(processor, "r", output)
    done = [j for j, (outs, _) in enumerate(results) if outs and outs[0].finished]
    assert len(done) == 1
    out = results[done[0]][0][0].outputs[0]
    assert out.text == " a 你" and out.stop_reason == "好" and REPLACEMENT not in out.text


def test_min_tokens_delays_stop_strings(story):
    tok, prompt, output, deltas = story
    stop = "cat"
    first, _ = expected_stop(deltas, stop)
    for min_tokens, label in [(first + 1, "completed exactly at min_tokens"), (first + 2, "delayed")]:
        stop_at, text = expected_stop(deltas, stop, min_tokens)
        if label == "completed exactly at min_tokens":
            assert stop_at == first
        else:
            assert stop_at > first and stop in text  # the early occurrence stays in the text
        processor = OutputProcessor(tok)
        processor.add_request("r", None, prompt, SamplingParams(stop=stop, min_tokens=min_tokens, max_tokens=100))
        results = feed(processor, "r", output)
        finished = [j for j, (outs, _) in enumerate(results) if outs and outs[0].finished]
        assert finished == [stop_at], label
        c = results[stop_at][0][0].outputs[0]
        assert c.text == text and c.finish_reason == "stop" and c.stop_reason == stop
        assert len(c.token_ids) >= min_tokens


def test_core_finish_and_stop_string_on_the_same_token(story):
    tok, prompt, output, deltas = story
    stop_at, text = expected_stop(deltas, "little")
    processor = OutputProcessor(tok)
    processor.add_request("r", None, prompt, SamplingParams(stop="little", max_tokens=stop_at + 1))
    results = feed(processor, "r", output[: stop_at + 1], finish_last="length")
    (out,), aborts = results[-1]
    assert aborts == []  # the core already finished it
    assert out.finished and out.outputs[0].text == text
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", "little")


def test_core_finish_reason_passes_through(story):
    tok, prompt, output, deltas = story
    processor = OutputProcessor(tok)
    processor.add_request("r", None, prompt, SamplingParams(stop="zebra", max_tokens=5))
    results = feed(processor, "r", output[:5], finish_last="length")
    (out,), aborts = results[-1]
    assert aborts == [] and out.finished
    assert out.outputs[0].text == "".join(deltas[:5])
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("length", None)
    eos = tok.eos_token_id
    processor.add_request("s", None, prompt, SamplingParams())
    processor.process([EngineCoreOutput("s", [output[0]])])
    (out,), _ = processor.process([EngineCoreOutput("s", [eos], finish_reason="stop", stop_reason=eos)])
    assert out.finished and out.outputs[0].text == deltas[0]  # the EOS adds no text
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", eos)


def test_n_samples_finish_together(story):
    tok, prompt, output, deltas = story
    processor = OutputProcessor(tok)
    core_ids = processor.add_request("req", None, prompt, SamplingParams(n=2, stop="happy", max_tokens=6))
    assert core_ids == ["0_req", "1_req"]
    other = tok.encode("The dog ran and ran and ran", add_special_tokens=False)
    other_texts = token_texts(tok, prompt, other)
    # Sample 0 finishes first by length; sample 1 runs on until its stop string.
    for i in range(6):
        finish = "length" if i == 5 else None
        (out,), aborts = processor.process([EngineCoreOutput("0_req", [other[i]], finish_reason=finish),
                                            EngineCoreOutput("1_req", [output[i]])])
        assert aborts == []
        assert not out.finished
        assert [c.index for c in out.outputs] == [0, 1]
        assert out.outputs[0].text == "".join(other_texts[: i + 1])
        assert out.outputs[1].text == "".join(deltas[: i + 1])
    assert out.outputs[0].finish_reason == "length" and out.outputs[1].finish_reason is None
    stop_at, text = expected_stop(deltas, "happy")
    assert stop_at > 6
    for i in range(6, stop_at + 1):
        # Output for the finished sample is ignored.
        outs, aborts = processor.process([EngineCoreOutput("1_req", [output[i]]),
                                          EngineCoreOutput("0_req", [other[0]])])
        (out,) = outs
        if i < stop_at:
            assert not out.finished and aborts == []
    assert aborts == ["1_req"]
    assert out.finished and out.request_id == "req"
    assert out.outputs[0].text == "".join(other_texts[:6]) and out.outputs[0].token_ids == other[:6]
    assert out.outputs[1].text == text and out.outputs[1].token_ids == output[: stop_at + 1]
    assert (out.outputs[1].finish_reason, out.outputs[1].stop_reason) == ("stop", "happy")
    assert processor.requests == {} and processor.samples == {}


def test_abort_returns_unfinished_samples(story):
    tok, prompt, output, _ = story
    processor = OutputProcessor(tok)
    processor.add_request("req", None, prompt, SamplingParams(n=3, max_tokens=2))
    processor.process([EngineCoreOutput("1_req", output[:1]), EngineCoreOutput("1_req", output[1:2], finish_reason="length")])
    assert processor.abort_request("req") == ["0_req", "2_req"]
    assert processor.abort_request("req") == []
    assert processor.process([EngineCoreOutput("0_req", [output[0]])]) == ([], [])


def test_random_byte_tokens_never_raise(hf_tokenizer, seed):
    """Random ids (a serving benchmark's prompts, a dummy model's outputs) make byte tokens that
    are no valid UTF-8; tokenizers' DecodeStream then raises "Invalid prefix". The detokenizer
    falls back to the window method for that request instead of failing it."""
    import random

    rng = random.Random(seed)
    vocab = hf_tokenizer.vocab_size
    for _ in range(100):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(hf_tokenizer, prompt, skip_special_tokens=True)
        texts = [detok.step(rng.randrange(vocab)) for _ in range(12)]
        assert all(isinstance(t, str) for t in texts)
