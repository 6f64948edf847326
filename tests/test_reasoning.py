"""Reasoning parsers: harmony replies (GPT-OSS) and <think> replies (Qwen3, DeepSeek-R1) split into
reasoning_content and content, whole or streamed in pieces; and the server's chat route on a harmony-templated tiny GPT-OSS model (the
parser on by default) whose greedy reply is a fixed harmony exchange (a "bigram machine": each
token's embedding picks the next token through the LM head, the decoder layer adds nothing)."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch

from baryon.server.reasoning import (REASONING_PARSERS, ReasoningCursor, default_reasoning_parser,
                                     reasoning_stream, split_harmony, split_reasoning)

REPLY = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")


def test_split_a_whole_reply():
    assert split_harmony(REPLY, finished=True) == ("The user greets; answer briefly.", "Hello there!")
    assert split_harmony("no markers at all", finished=True) == ("", "no markers at all")
    tool = ("<|channel|>analysis<|message|>need weather<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")
    assert split_harmony(tool, finished=True) == ("need weather", "")  # a tool call is neither
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done"
    assert split_harmony(preamble, finished=True) == ("", "Checking.Done")
    assert default_reasoning_parser("gpt_oss") == "harmony" and default_reasoning_parser("llama") is None


@pytest.mark.parametrize("trial", range(4))
def test_streamed_pieces_add_up_to_the_whole(seed, trial):
    """Cut the reply anywhere (inside markers too): the deltas never contain marker text and add
    up to the whole reply's split."""
    rng = random.Random(seed + trial)
    cuts = sorted(rng.sample(range(1, len(REPLY)), 12)) + [len(REPLY)]
    cursor, reasoning, content = ReasoningCursor(), "", ""
    for end in cuts:
        delta = cursor.advance(REPLY[:end], finished=end == len(REPLY))
        for part in delta.values():
            assert "<|" not in part and "|>" not in part
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
    assert (reasoning, content) == split_harmony(REPLY, finished=True)


# <think> replies: (parser, prompt_ends_in_reasoning, reply, (reasoning, content)).
THINK_CASES = [
    ("qwen3", False, "<think>\nThe user greets.\n</think>\n\nHello!", ("The user greets.", "Hello!")),
    ("qwen3", False, "<think>\n\n</think>\n\nHello", ("", "Hello")),  # empty reasoning
    ("qwen3", False, "Hello, no thinking.\n", ("", "Hello, no thinking.\n")),  # thinking off
    ("qwen3", False, "\n\nHi <b>there</b> </think> as text", ("", "\n\nHi <b>there</b> </think> as text")),
    ("qwen3", False, "<think>\nStill thinking when the tokens ran out", ("Still thinking when the tokens ran out", "")),
    ("qwen3", False, "<thi", ("", "<thi")),  # a finished reply that only looked like a marker
    ("qwen3", False, "", ("", "")),
    ("qwen3", False, "<think>a\n\nb  </think>\n\nline 1\n\nline 2\n", ("a\n\nb", "line 1\n\nline 2\n")),
    ("qwen3", False, "<think>x</think>y</think><think>z", ("x", "y</think><think>z")),  # one split only
    ("qwen3", False, "<think>\n日本語で考える 🤔 </thinking>\n</think>\n\nこんにちは 👋",
     ("日本語で考える 🤔 </thinking>", "こんにちは 👋")),
    ("qwen3", True, "Opened in the prompt.\n</think>\n\nAnswer.", ("Opened in the prompt.", "Answer.")),
    ("qwen3", True, "Never closed", ("Never closed", "")),
    ("deepseek_r1", False, "Okay, 2+2.\n</think>\n\n**4**", ("Okay, 2+2.", "**4**")),
    ("deepseek_r1", False, "<think>\nOkay.\n</think>\n\n4", ("Okay.", "4")),  # older templates
    ("deepseek_r1", False, "\n\n</think>\n\nDirect.", ("", "Direct.")),
    ("deepseek_r1", False, "All reasoning, no end <think> \n", ("All reasoning, no end <think>", "")),
    ("deepseek_r1", False, "é</think>", ("é", "")),
    ("deepseek_r1", False, "", ("", "")),
]


@pytest.mark.parametrize("parser,prompt_open,reply,expected", THINK_CASES)
def test_split_a_whole_think_reply(parser, prompt_open, reply, expected):
    assert split_reasoning(parser, reply, True, prompt_ends_in_reasoning=prompt_open) == expected


def test_think_reply_being_generated_holds_back_what_may_be_a_marker():
    assert split_reasoning("qwen3", "<thi", False) == ("", "")  # may become <think>
    assert split_reasoning("qwen3", "\n", False) == ("", "")  # may be followed by <think>
    assert split_reasoning("qwen3", "<b", False) == ("", "<b")  # can no longer become <think>
    assert split_reasoning("qwen3", "<think>\nStep one.\n</thi", False) == ("Step one.", "")
    assert split_reasoning("deepseek_r1", "Step one.\n\n", False) == ("Step one.", "")
    assert split_reasoning("deepseek_r1", "Step one.</think>\n\n", False) == ("Step one.", "")
    assert split_reasoning("deepseek_r1", "Step one.</think>\n\nA", False) == ("Step one.", "A")


def _stream(parser: str, prompt_open: bool, reply: str, cuts: list[int]) -> tuple[str, str]:
    """Feed the reply's prefixes ending at cuts (the last the whole reply, finished) to a stream;
    each step's deltas so far must equal split_reasoning of that prefix."""
    stream, reasoning, content = reasoning_stream(parser, prompt_open), "", ""
    for end in cuts:
        finished = end == len(reply)
        delta = stream.advance(reply[:end], finished)
        assert set(delta) <= {"reasoning_content", "content"} and all(delta.values())
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        assert (reasoning, content) == split_reasoning(parser, reply[:end], finished, prompt_open)
    return reasoning, content


@pytest.mark.parametrize("parser,prompt_open,reply,expected", THINK_CASES)
def test_streamed_think_pieces_add_up_to_the_whole(seed, parser, prompt_open, reply, expected):
    """Cut the reply into random pieces (inside markers too) and one character at a time."""
    rng = random.Random(seed)
    for _ in range(8):
        cuts, end = [], 0
        while end < len(reply):
            end = min(len(reply), end + rng.randint(1, 6))
            cuts.append(end)
        assert _stream(parser, prompt_open, reply, cuts or [0]) == expected
    assert _stream(parser, prompt_open, reply, list(range(1, len(reply) + 1)) or [0]) == expected


def test_the_parser_registry():
    assert REASONING_PARSERS == ("harmony", "qwen3", "deepseek_r1")
    assert default_reasoning_parser("qwen3") is None and default_reasoning_parser("deepseek_v3") is None
    assert split_reasoning("harmony", REPLY, True) == split_harmony(REPLY, finished=True)
    assert isinstance(reasoning_stream("harmony"), ReasoningCursor)
    # the same reply read by each parser: qwen3 sees no thinking, deepseek_r1 a reply inside it
    assert split_reasoning("qwen3", "a</think>b", True) == ("", "a</think>b")
    assert split_reasoning("deepseek_r1", "a</think>b", True) == ("a", "b")
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwen'.*deepseek_r1"):
        split_reasoning("qwen", "text", True)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_stream("think")
    with pytest.raises(ValueError, match="prompt_ends_in_reasoning"):
        reasoning_stream("harmony", prompt_ends_in_reasoning=True)

# The bigram machine's vocabulary: the prompt's words, then the reply's tokens in order. The
# markers are special tokens; their second occurrences are plain words with the same text, so
# every token of the reply has one successor.
PROMPT_WORDS = ["t0", "hi", "user", "system", "assistant"]
REPLY_TOKENS = ["<|channel|>", "analysis", "<|message|>", "Greet", "ing.", "<|end|>", "<|start|>",
                "assistant_", "<|channel|>_", "final", "<|message|>_", "Hello", "!", "<|return|>"]
SECOND = {"assistant_": "assistant", "<|channel|>_": "<|channel|>", "<|message|>_": "<|message|>"}
SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def _bigram_machine(path) -> None:
    """A tiny GPT-OSS whose greedy continuation of "... assistant" is REPLY_TOKENS, with a word-level
    tokenizer that decodes without spaces (the second markers: words of the markers' text) and the
    harmony-like chat template. Its attention output and expert down projections are zero, so the
    residual stream stays the token's embedding, which the LM head maps to the next token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedTokenizerFast

    words = PROMPT_WORDS + [t for t in REPLY_TOKENS if t not in SPECIAL]
    vocab = {w: i for i, w in enumerate(words)}
    for token in SPECIAL:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Sequence([decoders.Replace(f"{second}", text) for second, text in SECOND.items()]
                                          + [decoders.Fuse()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="<|return|>",
                                   additional_special_tokens=[t for t in SPECIAL if t != "<|return|>"])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    size = 64
    config = GptOssConfig(vocab_size=len(vocab), hidden_size=size, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=128,
                          tie_word_embeddings=False, eos_token_id=vocab["<|return|>"], pad_token_id=0)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        embed = torch.linalg.qr(torch.randn(size, size))[0][: len(vocab)] * size ** 0.5  # orthogonal rows
        model.model.embed_tokens.weight.copy_(embed)
        layer = model.model.layers[0]
        for param in (layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, layer.mlp.experts.down_proj,
                      layer.mlp.experts.down_proj_bias):
            param.zero_()  # the layer adds nothing to the residual stream
        head = torch.zeros(len(vocab), size)
        chain = ["assistant"] + REPLY_TOKENS
        for current, following in zip(chain, chain[1:]):
            head[vocab[following]] = embed[vocab[current]] / size ** 0.5 * 10
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)


def test_server_chat_separates_reasoning_from_content(tmp_path):
    from test_server import ServerProcess

    _bigram_machine(tmp_path)
    proc = ServerProcess(tmp_path, "--max-model-len", "128").wait_ready()  # GPT-OSS: harmony by default
    try:
        body = {"model": str(tmp_path), "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                "max_tokens": 32}
        reply = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=60).json()
        message = reply["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Greeting.", "Hello!")
        assert reply["choices"][0]["finish_reason"] == "stop"
        reasoning = content = ""
        with httpx.stream("POST", f"{proc.url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    reasoning += delta.get("reasoning_content") or ""
                    content += delta.get("content") or ""
        assert (reasoning, content) == ("Greeting.", "Hello!")
    finally:
        proc.stop()


def test_harmony_call_addressed_before_its_channel_is_not_content(seed):
    """`<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{...}<|call|>` is a tool
    call (the tool parser's), whole and streamed in random pieces."""
    import random

    from baryon.server.reasoning import reasoning_stream, split_reasoning

    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
            "<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}<|call|>")
    assert split_reasoning("harmony", text, finished=True) == ("Need the weather.", "")
    rng, stream, parts = random.Random(seed), reasoning_stream("harmony"), {"reasoning_content": "", "content": ""}
    end = 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, 7))
        for key, value in stream.advance(text[:end], end == len(text)).items():
            parts[key] += value
    assert parts == {"reasoning_content": "Need the weather.", "content": ""}
