"""`baryon chat` with the default model (SmolLM2-135M-Instruct from its GGUF): the chat template
renders exactly as transformers renders it, the conversation history and /reset, Ctrl-C during a
reply, and the CLI driven through a pipe."""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys

import pytest

from baryon import LLM, SamplingParams
from baryon.chat import ChatSession, run_chat
from conftest import TEST_SEED

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
QUESTIONS = [
    "What is the capital of France?", "Name a primary colour.", "How many legs does a spider have?",
    "Say hello in Spanish.", "What is 2 + 2?", "Who wrote Hamlet?", "What do bees make?",
    "Give me a word that rhymes with cat.", "What is the boiling point of water?", "Name a planet.",
]
SYSTEMS = [None, "You are a pirate. Answer in pirate speak.", "Answer in one word."]


@pytest.fixture(scope="module")
def smol(smol_path) -> LLM:
    return LLM(smol_path, device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=2)


@pytest.fixture(scope="module")
def hf_tokenizer(smol_path):
    """The reference: transformers' own tokenizer from the GGUF file."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(smol_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def conversation(seed: int, turns: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    system = rng.choice(SYSTEMS)
    messages = [{"role": "system", "content": system}] if system else []
    for question in rng.sample(QUESTIONS, turns):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": rng.choice(QUESTIONS)}]
    return messages[:-1]  # ends with a user turn


def expected_replies(llm: LLM, questions: list[str], system: str | None = None) -> list[str]:
    """Greedy replies of a conversation, turn by turn, through LLM.chat (the offline API)."""
    messages = [{"role": "system", "content": system}] if system else []
    replies = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        replies.append(llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].text)
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def test_chat_template_renders_as_transformers(smol, hf_tokenizer, seed):
    messages = conversation(seed, turns=3)
    ours = smol.get_tokenizer()
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count("<|im_start|>") == len(messages) + 1 + (messages[0]["role"] != "system")
    # The token ids the engine runs are those transformers gives for the conversation.
    expected_ids = list(hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False))
    out = smol.chat(messages, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == expected_ids
    for text in [m["content"] for m in messages] + [" two  spaces\n\ttab", "Ünïcödé 日本語 🙂", "<|im_end|>x"]:
        assert ours.encode(text) == hf_tokenizer.encode(text), text
    assert (ours.bos_token, ours.eos_token) == (hf_tokenizer.bos_token, hf_tokenizer.eos_token)


@pytest.fixture(scope="module")
def two_turns(smol) -> tuple[list[str], list[str], str]:
    """Two questions drawn for this run, the greedy replies of that conversation, and the reply to
    the second question asked alone (shared by the in-process and the piped-CLI tests)."""
    questions = random.Random(TEST_SEED).sample(QUESTIONS, 2)
    return questions, expected_replies(smol, questions), expected_replies(smol, questions[1:])[0]


def test_history_and_reset(smol, two_turns):
    (first, second), replies, fresh = two_turns
    stdout = io.StringIO()
    code = run_chat(smol, GREEDY, stdin=io.StringIO(f"{first}\n{second}\n/reset\n{second}\n/exit\n{first}\n"),
                    stdout=stdout)
    assert code == 0
    assert stdout.getvalue() == f"{replies[0]}\n{replies[1]}\n{fresh}\n"  # nothing after /exit


def test_system_prompt(smol, seed):
    question = random.Random(seed).choice(QUESTIONS)
    params = SamplingParams(temperature=0, max_tokens=4)
    session = ChatSession(smol, params, system=SYSTEMS[1])
    pieces: list[str] = []
    reply = session.reply(question, pieces.append)
    expected = smol.chat([{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": question}],
                         params, use_tqdm=False)[0].outputs[0].text
    assert reply == "".join(pieces) == expected
    assert session.messages[0] == {"role": "system", "content": SYSTEMS[1]}
    session.reset()
    assert session.messages == [{"role": "system", "content": SYSTEMS[1]}]


def test_stop_string_text_is_never_shown(smol, two_turns, seed):
    """Streaming holds back text that may still turn out to start a stop string."""
    (question, _), (full, _), _ = two_turns
    assert len(full) >= 3, f"reply {full!r} is too short to hold a stop string"
    start = random.Random(seed).randrange(1, len(full) - 1)
    stop = full[start:start + 2]  # two characters that may span a token boundary
    pieces: list[str] = []
    reply = ChatSession(smol, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop])).reply(
        question, pieces.append)
    assert "".join(pieces) == reply == full[:full.find(stop)]


def test_ctrl_c_stops_the_reply_not_the_chat(smol, seed):
    question = random.Random(seed).choice(QUESTIONS)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    session = ChatSession(smol, params)
    pieces: list[str] = []

    def write(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 2:
            signal.raise_signal(signal.SIGINT)  # as a Ctrl-C would, between two engine steps

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when started with SIGINT ignored
    reply = session.reply(question, write)
    full = smol.chat([{"role": "user", "content": question}], params, use_tqdm=False)[0].outputs[0].text
    assert reply == "".join(pieces) and full.startswith(reply) and len(reply) < len(full)
    assert not smol.engine.has_unfinished_requests()
    assert session.messages[-1] == {"role": "assistant", "content": reply}
    assert signal.getsignal(signal.SIGINT) is before  # restored
    assert session.reply(question, lambda text: None)  # the next turn still works


def test_model_without_chat_template_is_refused(stories_path):
    llm = LLM(str(stories_path), device="cpu")
    with pytest.raises(ValueError, match="no chat template"):
        ChatSession(llm, GREEDY)


def test_cli_chat_through_a_pipe(two_turns):
    """`baryon chat` with no --model (the default model), two turns on stdin, then end of input."""
    questions, replies, _ = two_turns
    proc = subprocess.run(
        [sys.executable, "-m", "baryon.cli", "chat", "--temperature", "0", "--max-tokens", str(MAX_TOKENS),
         "--max-model-len", "1024", "--device", "cpu"],
        input="".join(f"{q}\n" for q in questions), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "".join(f"{r}\n" for r in replies)
