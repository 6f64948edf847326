"""The real stories260K checkpoint: golden greedy text, the CLI, chat templates, n > 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from baryon import LLM, SamplingParams

GOLDEN = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
          "One day, she saw a big, red ball.")


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), device="cpu")


def test_golden_greedy_text(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert out.prompt + out.outputs[0].text == GOLDEN
    assert len(out.outputs[0].token_ids) == 40
    assert out.outputs[0].finish_reason == "length"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Once upon a time")


def test_token_id_prompts_match_text_prompts(llm):
    ids = llm.get_tokenizer().encode("Once upon a time")
    params = SamplingParams(temperature=0, max_tokens=12)
    by_text = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    by_ids = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    assert by_ids.token_ids == by_text.token_ids and by_ids.text == by_text.text


def test_cli_generate_prints_golden_text(stories_path):
    proc = subprocess.run(
        [sys.executable, "-m", "baryon.cli", "generate", "--model", str(stories_path), "--prompt",
         "Once upon a time", "--max-tokens", "40", "--temperature", "0"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == GOLDEN


def test_cli_json_and_prompts_file(stories_path, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe dog\n")
    proc = subprocess.run(
        [sys.executable, "-m", "baryon.cli", "generate", "--model", str(stories_path), "--prompts-file",
         str(prompts), "--max-tokens", "8", "--temperature", "0", "--json", "--logprobs", "2"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["Once upon a time", "The dog"]
    first = lines[0]["outputs"][0]
    assert len(first["token_ids"]) == 8 and len(first["logprobs"]) == 8
    assert GOLDEN.startswith(lines[0]["prompt"] + first["text"])


def test_cli_reports_bad_input_cleanly(stories_path):
    proc = subprocess.run(
        [sys.executable, "-m", "baryon.cli", "generate", "--model", str(stories_path), "--prompt", "x",
         "--temperature", "-1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_needs_a_template(llm):
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_chat_with_explicit_template(llm):
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    messages = [{"role": "user", "content": "Tell me a story"}]
    params = SamplingParams(temperature=0, max_tokens=10)
    chat = llm.chat(messages, params, chat_template=template, use_tqdm=False)[0]
    rendered = llm.get_tokenizer().apply_chat_template(messages, chat_template=template, tokenize=False,
                                                       add_generation_prompt=True)
    assert rendered == "user: Tell me a story\nassistant:"
    ids = llm.get_tokenizer().encode(rendered, add_special_tokens=False)  # the template owns special tokens
    assert chat.prompt_token_ids == ids
    direct = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


def test_n_samples_and_stop_strings(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20)
    out = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "seeded samples should differ"
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    stopped = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=["Lily"]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.text == ", there was a little girl named "
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Lily"


def test_prompt_logprobs(llm):
    tokenizer = llm.get_tokenizer()
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert ids[position] in entry  # the actual prompt token is always reported
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks[0] == 1 and len(entry) <= 4
    # each token's text as it reads in the prompt (SentencePiece's "▁upon" is " upon" there), so
    # the tokens after the first add up to the rest of the text
    rest = "".join(out.prompt_logprobs[p][ids[p]].decoded_token for p in range(2, len(ids)))
    assert tokenizer.decode(ids[:2], skip_special_tokens=True) + rest == "Once upon a time"
    assert rest.startswith(" ")
    # a one-token prompt: one entry, None (no token before the first to predict it)
    alone = llm.generate({"prompt_token_ids": ids[:1]}, SamplingParams(max_tokens=2, prompt_logprobs=1),
                         use_tqdm=False)[0]
    assert alone.prompt_logprobs == [None]
