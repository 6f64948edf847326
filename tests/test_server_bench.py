"""`baryon bench serve` against a server without a tokenizer (as a GPU benchmark runs a preset:
token-id prompts, no text), and what such a server accepts and refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from test_server import ServerProcess, assert_error_shape


@pytest.fixture(scope="module")
def server(stories_path):
    proc = ServerProcess(stories_path, "--skip-tokenizer-init", "--max-model-len", "128")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


CLI = [sys.executable, "-m", "baryon.cli", "bench", "serve"]
SCRIPT = [sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "serve.py")]


def bench(server: ServerProcess, command: list[str], *flags: str) -> dict:
    proc = subprocess.run([*command, "--base-url", server.url, *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_serve_benchmark_reports_every_request(server, seed):
    result = bench(server, CLI, "--num-prompts", "16", "--random-input-len", "12", "--random-output-len", "6",
                   "--max-concurrency", "4", "--seed", str(seed))
    assert result["completed"] == 16 and result["failed"] == 0
    assert result["total_input_tokens"] == 16 * 12 and result["total_output_tokens"] == 16 * 6
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert result["total_token_throughput"] > result["output_throughput"]
    for name in ("ttft", "e2el"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"], name
    # A client that lags reads a request's later tokens in one chunk (the server sends the latest
    # cumulative output), so on a busy machine the time per output token may be 0 for some.
    for name in ("tpot", "itl"):
        assert 0 <= result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"], name
    assert result["mean_tpot_ms"] <= result["mean_e2el_ms"]
    assert result["mean_e2el_ms"] >= result["mean_ttft_ms"]


def test_serve_benchmark_poisson_arrivals_and_length_ranges(server, seed):
    result = bench(server, SCRIPT, "--num-prompts", "8", "--random-input-len", "20", "--random-output-len", "4",
                   "--random-range-ratio", "0.5", "--request-rate", "40", "--seed", str(seed))
    assert result["completed"] == 8 and result["request_rate"] == 40
    assert 8 * 10 <= result["total_input_tokens"] <= 8 * 30


def test_without_a_tokenizer_prompts_are_token_ids(server):
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": [1, 403, 407], "max_tokens": 3, "temperature": 0, "logprobs": 1})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == "" and len(choice["logprobs"]["tokens"]) == 3
    assert all(token.startswith("token_id:") for token in choice["logprobs"]["tokens"])
    for route, body in [("/v1/completions", {"prompt": "Once upon a time"}),
                        ("/v1/completions", {"prompt": [1, 403], "stop": ["x"]}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/tokenize", {"prompt": "hi"}),
                        ("/detokenize", {"tokens": [1, 403]})]:
        assert_error_shape(httpx.post(f"{server.url}{route}", json=body, timeout=60), 400)
