"""The OpenAI-compatible server: a real `baryon serve` subprocess on stories260K, driven by the
official openai client, httpx and schemathesis.

One server serves this module (API key, chat template, max_model_len 256); greedy results are
compared with LLM.generate / LLM.chat in this process. `ServerProcess` is shared with
test_server_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baryon import LLM, SamplingParams
from baryon.config import free_port

API_KEY = "sk-test"
MODEL = "stories"
MAX_MODEL_LEN = 256
VOCAB_SIZE = 512  # stories260K's; random token-id prompts draw from all of it (byte tokens included)
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def child_pids(pid: int) -> list[int]:
    """Every live descendant of a process (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in parents.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def post_concurrently(url: str, route: str, bodies: list[dict], timeout_s: float = 60) -> list[dict]:
    """POST every body at once (a thread each); their JSON answers, in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: httpx.post(f"{url}{route}", json=body, timeout=timeout_s).json(), bodies))


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServerProcess:
    """`baryon serve` in a subprocess on a free port; its output goes to a log file."""

    def __init__(self, model: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="baryon-serve-", suffix=".log", delete=False)
        env = {**os.environ, "BARYON_LOG_LEVEL": "WARNING"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "baryon.cli", "serve", str(model), "--port", str(self.port),
             "--uvicorn-log-level", "warning", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 300) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode} while starting:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not become healthy in {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-5000:]

    def engine_pid(self) -> int:
        (pid,) = child_pids(self.process.pid)
        return pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                for pid in child_pids(self.process.pid):
                    os.kill(pid, signal.SIGKILL)
                self.process.kill()
                self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    proc = ServerProcess(stories_path, "--api-key", API_KEY, "--served-model-name", MODEL, "--chat-template",
                         str(template), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), device="cpu", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def greedy(llm: LLM, prompt, max_tokens: int, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def scrape(server: ServerProcess) -> dict[str, float]:
    """/metrics as {sample name: value} (one model, so labels do not matter)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_bucket")}


def random_text_prompts(rng: random.Random, count: int) -> list[str]:
    words = ["Once", "upon", "a", "time", "the", "little", "dog", "Lily", "saw", "big", "red", "ball", "and",
             "happy", "tree", "sun", "mom", "said", "play", "park"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(count)]


# -- completions and chat against the offline engine -------------------------------------------


def test_completion_greedy_equals_llm_generate(client, llm, seed):
    rng = random.Random(seed)
    for prompt in random_text_prompts(rng, 3):
        reference = greedy(llm, prompt, 24)
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        choice = result.choices[0]
        assert choice.text == reference.text, prompt
        assert choice.finish_reason == reference.finish_reason
        assert result.usage.completion_tokens == len(reference.token_ids)
        assert result.usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt))
        assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
        assert result.model == MODEL and result.object == "text_completion"


def test_completion_token_id_prompts_and_a_batch(client, llm, seed):
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(2, 20))] for _ in range(3)]
    result = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.index for c in result.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, result.choices):
        assert choice.text == greedy(llm, {"prompt_token_ids": prompt}, 12).text
    assert result.usage.prompt_tokens == sum(map(len, prompts))


def test_completion_stream_equals_non_stream(client, llm):
    reference = greedy(llm, "Once upon a time", 20)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_equals_llm_chat(client, llm):
    messages = [{"role": "user", "content": "Tell me a story about a dog."}]
    reference = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False,
                         chat_template=CHAT_TEMPLATE)[0]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    assert result.choices[0].message.content == reference.outputs[0].text
    assert result.choices[0].message.role == "assistant"
    assert result.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert result.usage.completion_tokens == 20
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.outputs[0].text
    assert chunks[-1].usage.total_tokens == len(reference.prompt_token_ids) + 20


def test_chat_without_max_tokens_fills_the_context(client, llm):
    messages = [{"role": "user", "content": "the dog saw a big red ball " * 23}]  # leaves little room
    prompt_len = len(llm.get_tokenizer().apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=True,
                                                             add_generation_prompt=True, return_dict=False))
    assert MAX_MODEL_LEN - 40 < prompt_len < MAX_MODEL_LEN
    result = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert result.usage.prompt_tokens == prompt_len
    assert result.usage.total_tokens == MAX_MODEL_LEN
    assert result.choices[0].finish_reason == "length"


def test_n2_seeded_sampling_equals_llm_generate(client, llm, seed):
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=seed, max_tokens=16)
    reference = llm.generate("The little dog", params, use_tqdm=False)[0].outputs
    result = client.completions.create(model=MODEL, prompt="The little dog", n=2, temperature=0.9, top_p=0.95,
                                       seed=seed, max_tokens=16)
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert [c.text for c in sorted(result.choices, key=lambda c: c.index)] == [o.text for o in reference]
    assert result.usage.completion_tokens == sum(len(o.token_ids) for o in reference)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          seed=seed, max_tokens=8)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_sampling_extensions_reach_the_engine(client, llm):
    kwargs = dict(top_k=5, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)
    reference = llm.generate("Lily saw a big", SamplingParams(temperature=0.8, seed=7, max_tokens=16, **kwargs),
                             use_tqdm=False)[0].outputs[0]
    result = client.completions.create(model=MODEL, prompt="Lily saw a big", temperature=0.8, seed=7, max_tokens=16,
                                       presence_penalty=0.5, frequency_penalty=0.5,
                                       extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3})
    assert result.choices[0].text == reference.text


def test_completion_logprobs_match_the_engine(client, llm):
    reference = greedy(llm, "Once upon a time", 8, logprobs=3)
    result = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 8
    for token_id, position, value, top in zip(reference.token_ids, reference.logprobs, logprobs.token_logprobs,
                                              logprobs.top_logprobs):
        assert value == pytest.approx(position[token_id].logprob, abs=1e-5)
        assert len(top) <= 3 and max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the top token
    # the tokens add up to the text (a SentencePiece token keeps its leading space) and each
    # offset points at its token in it
    text = result.choices[0].text
    assert "".join(logprobs.tokens) == text == reference.text
    assert all(text[offset:].startswith(token) for offset, token in zip(logprobs.text_offset, logprobs.tokens))
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_with_logprobs_covers_the_prompt(client, llm):
    prompt_ids = llm.get_tokenizer().encode("Once upon a time")
    result = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                       echo=True, logprobs=1)
    choice = result.choices[0]
    assert choice.text == "Once upon a time" + greedy(llm, "Once upon a time", 4).text
    assert len(choice.logprobs.tokens) == len(prompt_ids) + 4
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])
    # The BOS the tokenizer added is not in the echoed text: it takes no width, and every other
    # token's offset points at it in the text (the first word's without the space SentencePiece
    # reads before it), streamed alike.
    logprobs = choice.logprobs
    assert prompt_ids[0] == llm.get_tokenizer().bos_token_id and logprobs.text_offset[:2] == [0, 0]
    assert choice.text.startswith(logprobs.tokens[1].lstrip(" "))
    assert all(choice.text[offset:].startswith(token)
               for offset, token in zip(logprobs.text_offset[2:], logprobs.tokens[2:]))
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                       echo=True, logprobs=1, stream=True)
    offsets = [o for chunk in stream for c in chunk.choices if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == logprobs.text_offset


@pytest.mark.parametrize("prompt", ["日本語🌧 rain", "a 語 b", "Once upon a time"])
def test_echo_offsets_point_into_the_prompt_as_shown(client, prompt):
    """Offsets of an echoed prompt split into byte tokens (each byte of a character points at
    it): non-decreasing, each whole token found at its offset, and the generated tokens after
    the prompt's end."""
    for stream in (False, True):
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                           logprobs=0, stream=stream)
        chunks = list(result) if stream else [result]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
        n_prompt = len(tokens) - 3
        assert offsets == sorted(offsets) and offsets[n_prompt:][0] == len(prompt), (offsets, tokens)
        for offset, token in zip(offsets[2:n_prompt], tokens[2:n_prompt]):
            assert "\ufffd" in token or text[offset:].startswith(token), (offset, token, text)


def test_chat_logprobs_shape(client, llm):
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy
        assert entry.bytes == list(entry.token.encode("utf-8"))
    assert "".join(entry.token for entry in content) == result.choices[0].message.content


def test_stop_strings_cut_the_text_streaming_or_not(client, llm):
    full = greedy(llm, "Once upon a time", 40).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    result = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0, stop=[stop])
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected
    chat_stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a story"}],
                                                 max_tokens=30, temperature=0, stream=True, stop=[" "])
    chat_text = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
    assert " " not in chat_text


def test_64_concurrent_streams_each_equal_solo_greedy(server, llm, seed):
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 16))] for _ in range(64)]
    max_tokens = [rng.randint(2, 10) for _ in prompts]
    # One batched call gives every reference (the engine is batch invariant); a few are checked solo.
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], use_tqdm=False)
    references = [output.outputs[0].text for output in batch]
    for i in rng.sample(range(len(prompts)), 4):
        assert greedy(llm, {"prompt_token_ids": prompts[i]}, max_tokens[i]).text == references[i]

    async def stream_one(aclient, prompt, max_tokens):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(stream_one(aclient, p, m) for p, m in zip(prompts, max_tokens)))

    results = asyncio.run(run_all())
    assert results == references


# -- cancellation ----------------------------------------------------------------------------


def wait_for_idle_engine(server: ServerProcess, baseline: dict[str, float], timeout_s: float = 10) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(server)
        if (metrics["baryon:num_requests_running"] == baseline["baryon:num_requests_running"]
                and metrics["baryon:kv_cache_used_blocks"] == baseline["baryon:kv_cache_used_blocks"]):
            return metrics
        assert time.monotonic() < deadline, f"the engine did not free the request: {metrics}"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_request(server):
    baseline = wait_for_idle_engine(server, {"baryon:num_requests_running": 0, "baryon:kv_cache_used_blocks": 0})
    # As many samples as the server runs at once (--max-num-seqs 64), each to the end of the context:
    # ~16k tokens, so the disconnect cannot arrive after the whole request has run (one sample once
    # finished first on a busy CI machine, and eight once did too).
    max_tokens, n = MAX_MODEL_LEN - 10, 64
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "n": n}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: a dropped iterator would close the connection
        events = 0
        for line in lines:
            events += line.startswith("data:")
            if events == 3:
                break
        # Closed at once: anything in between (a metrics scrape) gives the request time to finish.
    after = wait_for_idle_engine(server, baseline)
    generated = after["baryon:generation_tokens_total"] - baseline["baryon:generation_tokens_total"]
    assert 3 <= generated < n * max_tokens  # it ran, and was aborted, not run to the end


def test_disconnect_while_waiting_for_a_full_response_frees_the_request(server):
    baseline = wait_for_idle_engine(server, {"baryon:num_requests_running": 0, "baryon:kv_cache_used_blocks": 0})
    # Enough work that running it to the end takes several times the read timeout (n = 8 with a
    # 0.5 s timeout once finished first on a fast moment of a CI machine: 1,920 tokens).
    n = 32
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True,
            "n": n}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(10, read=0.2))
    after = wait_for_idle_engine(server, baseline)
    generated = after["baryon:generation_tokens_total"] - baseline["baryon:generation_tokens_total"]
    assert generated < n * (MAX_MODEL_LEN - 20)  # aborted, not run to the end


# -- the other endpoints ---------------------------------------------------------------------


def test_models_health_version_tokenize_detokenize(server, client, llm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.head(f"{server.url}/health").status_code == 200  # load balancers probe with HEAD
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for route in ("/version", "/metrics", "/v1/models"):  # every GET route answers HEAD, without a body
        head = httpx.head(f"{server.url}{route}", headers=auth)
        assert head.status_code == 200 and head.content == b"", (route, head.status_code)
    # a route's other methods: 405 naming what is allowed, in the message and the Allow header
    wrong = httpx.post(f"{server.url}/v1/models", headers=auth, json={})
    error = assert_error_shape(wrong, 405)
    assert set(wrong.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
    assert "POST" in error["message"] and "GET" in error["message"], error
    assert httpx.get(f"{server.url}/v1/completions", headers=auth).headers.get("allow") == "POST"
    assert httpx.get(f"{server.url}/version").json() == {"version": "0.1.0"}
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Once upon a time"}).json()
    assert tokens["tokens"] == llm.get_tokenizer().encode("Once upon a time")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"][1:]}).json()
    assert text == {"prompt": "Once upon a time"}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hi"}], chat_template=CHAT_TEMPLATE, tokenize=True, add_generation_prompt=True,
        return_dict=False)


def test_metrics_count_tokens_and_latencies(server, client):
    before = scrape(server)
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0)
    after = scrape(server)
    assert after["baryon:generation_tokens_total"] - before["baryon:generation_tokens_total"] == 7
    assert after["baryon:prompt_tokens_total"] - before["baryon:prompt_tokens_total"] == 5
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"baryon:{name}_count"] == before.get(f"baryon:{name}_count", 0) + 1
    assert after["baryon:kv_cache_total_blocks"] > 0 and after["baryon:engine_alive"] == 1


# -- errors ----------------------------------------------------------------------------------

OK = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (route, body (dict, or raw bytes), expected status, the error's param (or None)).
BAD_REQUESTS = [
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**OK, "max_tokens": "2"}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "n": 1.5}, 400, "n"),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**OK, "prompt": 42}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {**OK, "stop": 5}, 400, "stop"),
    ("/v1/completions", {**OK, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**OK, "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {**OK, "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {**OK, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {**OK, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {**OK, "n": 0}, 400, "n"),
    ("/v1/completions", {**OK, "n": 10**6}, 400, "n"),
    ("/v1/completions", {**OK, "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {**OK, "logprobs": 1000}, 400, "logprobs"),
    ("/v1/completions", {**OK, "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {**OK, "top_k": 10**30}, 400, "top_k"),
    ("/v1/completions", {**OK, "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {**OK, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {**OK, "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ("/v1/completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": [600]}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": [5] * MAX_MODEL_LEN}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": "Once upon a time " * 200}, 400, "prompt"),
    ("/v1/completions", {**OK, "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {**OK, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {**OK, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {**OK, "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {**OK, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", b'{"prompt": "x",', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, 400, "messages.0"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400,
     "messages.0"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 3}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 100}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "story " * 300}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    # half a UTF-16 surrogate pair, escaped in valid JSON: not Unicode any tokenizer takes
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": "a\ud800b"}, 400, "prompt"),
    ("/v1/completions", {**OK, "stop": "\udfff"}, 400, "stop"),
    ("/v1/completions", {**OK, "stream": True, "stop": ["x", "\udfff"]}, 400, "stop[1]"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi \ud800"}]}, 400,
     "messages[0].content"),
    ("/v1/completions", {**OK, "prompt": [[1]] * 65}, 400, "prompt"),  # more prompts than --max-num-seqs 64
    # values float32 cannot hold, which the sampler computes in
    ("/v1/completions", {**OK, "temperature": 1e39}, 400, "temperature"),
    ("/v1/completions", {**OK, "repetition_penalty": 1e-46}, 400, "repetition_penalty"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/v1/nothing", {}, 404, None),
]


def post(server: ServerProcess, route: str, body, headers: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{route}", content=content, headers=headers, timeout=60)


def assert_error_shape(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("route,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{r[0]}-{r[3]}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_an_openai_error(server, route, body, status, param):
    assert_error_shape(post(server, route, body), status, param)


def test_a_body_that_is_not_utf8_json_is_named(server):
    error = assert_error_shape(post(server, "/v1/completions", b'{"prompt": "caf\xe9"}'), 400)
    assert "not UTF-8" in error["message"] and error["code"] == "invalid_body", error
    for encoding in ("gzip", "br"):  # refused by the header, whatever the bytes decode to
        body = gzip.compress(json.dumps(OK).encode())
        error = assert_error_shape(post(server, "/v1/completions", body, {"Content-Encoding": encoding}), 400)
        assert f"Content-Encoding '{encoding}' is not supported" in error["message"], error
    plain = post(server, "/v1/completions", json.dumps({**OK, "max_tokens": 1}).encode(), {"Content-Encoding": "identity"})
    assert plain.status_code == 200, plain.text


def test_deeply_nested_values_are_named(server):
    """A body nested past what Python's JSON parser takes, and chat_template_kwargs nested past what
    Jinja renders: 400s that say so (not a template error naming the messages)."""
    deep = '{"a": ' * 5000 + '"x"' + "}" * 5000
    body = ('{"model": "%s", "prompt": "hi", "max_tokens": 2, "stop": %s}' % (MODEL, deep)).encode()
    error = assert_error_shape(post(server, "/v1/completions", body), 400)
    assert "nests JSON values too deeply" in error["message"], error
    kwargs: object = "x"
    for _ in range(900):
        kwargs = [kwargs]
    error = assert_error_shape(post(server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"k": kwargs}}),
                               400, "chat_template_kwargs")
    assert "levels deep" in error["message"], error


def test_unsupported_field_is_named_in_the_message(server):
    error = assert_error_shape(post(server, "/v1/completions", {**OK, "suffix": "x"}), 400, "suffix")
    assert "suffix" in error["message"] and error["code"] == "unsupported_parameter"


def test_api_key_is_required_on_v1_routes(server):
    assert_error_shape(post(server, "/v1/completions", OK, {"Authorization": "Bearer wrong"}), 401)
    assert_error_shape(httpx.post(f"{server.url}/v1/completions", json=OK), 401)
    assert_error_shape(httpx.get(f"{server.url}/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # outside /v1: open


def test_openai_client_raises_on_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="x", top_p=7)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**6)


def shorten(case) -> None:
    """Keep a fuzzed generation short (at most 4 tokens, n <= 4): the point is the input."""
    body = case.body
    if case.path not in ("/v1/completions", "/v1/chat/completions") or not isinstance(body, dict):
        return

    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if body.get(name) is None or (is_int(body[name]) and body[name] > 4):
        body[name] = 4
    if is_int(body.get("n")) and body["n"] > 4:
        body["n"] = 4


def test_fuzzed_requests_never_get_a_5xx(server, seed):
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    # Schema-conforming requests and requests that break the schema (wrong types, missing fields).
    strategy = (schema.as_strategy(schemathesis.GenerationMode.POSITIVE)
                | schema.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    statuses: list[int] = []

    @hypothesis.seed(seed)
    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
    @given(case=strategy)
    def check(case):
        shorten(case)
        response = case.call(base_url=server.url, headers=headers, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)

    check()
    assert len(statuses) >= 50
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert scrape(server)["baryon:engine_alive"] == 1


def test_an_unexpected_error_mid_stream_ends_the_stream_with_an_error_event():
    """A failure that is not the engine's (a bug of ours) after the stream started: the client
    gets an error event and [DONE], not a connection cut mid-stream."""
    import asyncio

    from baryon.server.serving import streaming_response

    async def events():
        yield b"data: {}\n\n"
        raise KeyError("boom")

    async def collect() -> list[bytes]:
        return [chunk async for chunk in streaming_response(events()).body_iterator]

    chunks = asyncio.run(collect())
    assert chunks[0] == b"data: {}\n\n" and chunks[-1] == b"data: [DONE]\n\n" and len(chunks) == 3
    error = json.loads(chunks[1].decode().removeprefix("data: "))["error"]
    assert error["status"] == 500 and "KeyError" in error["message"], error
