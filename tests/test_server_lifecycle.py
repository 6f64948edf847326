"""Stopping the server and losing processes: nothing hangs and nothing is left behind.

Each test starts its own `baryon serve` (ServerProcess from test_server.py): SIGTERM with a
stream in flight, the engine process killed under the server, the server killed under the
engine.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from test_server import ServerProcess, child_pids, pid_alive

# Eight samples of 500 tokens: a few seconds of work on stories260K, so that a kill or a stop lands
# while they run (one sample, ~0.2 s, once finished before the engine was killed on a CI machine).
LONG_STREAM = {"prompt": "Once upon a time", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True,
               "n": 8}
LONG_COMPLETION = {"prompt": "The little dog", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "n": 8}


class StreamReader(threading.Thread):
    """Reads one SSE stream in the background; `started` is set at its first event."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.events: list[str] = []
        self.started = threading.Event()
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=LONG_STREAM, timeout=30) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.started.set()
        except httpx.HTTPError as e:  # the server may close the connection while stopping
            self.error = e
        finally:
            self.started.set()


class Poster(threading.Thread):
    """One non-streaming request in the background."""

    def __init__(self, url: str, route: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.route, self.body = url, route, body
        self.response: httpx.Response | None = None
        self.start()

    def run(self) -> None:
        self.response = httpx.post(f"{self.url}{self.route}", json=self.body, timeout=30)


def wait_until_gone(pids: list[int], deadline: float) -> None:
    while any(pid_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {[pid for pid in pids if pid_alive(pid)]}"
        time.sleep(0.05)


@pytest.fixture
def server(stories_path):
    proc = ServerProcess(stories_path, "--max-model-len", "512")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_sigterm_mid_stream_stops_everything_within_10s(server):
    tree = [server.process.pid, *child_pids(server.process.pid)]
    assert len(tree) == 2  # the server and its engine process
    stream = StreamReader(server.url)
    assert stream.started.wait(60) and stream.events
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(10) == 0
    wait_until_gone(tree, start + 10)
    stream.join(5)
    assert not stream.is_alive()
    if stream.error is None:  # the stream ended in order: a 503 error event, then [DONE]
        assert stream.events[-1] == "[DONE]"
        error = json.loads(stream.events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "shutting down" in error["message"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)


def test_engine_death_fails_requests_fast_and_turns_health_503(server):
    stream = StreamReader(server.url)
    assert stream.started.wait(60)
    waiting = Poster(server.url, "/v1/completions", LONG_COMPLETION)
    time.sleep(0.2)  # let it reach the engine
    start = time.monotonic()
    os.kill(server.engine_pid(), signal.SIGKILL)
    stream.join(5)
    waiting.join(5)
    assert not stream.is_alive() and not waiting.is_alive()
    assert time.monotonic() - start < 5
    assert stream.events[-1] == "[DONE]"
    error = json.loads(stream.events[-2])["error"]
    assert error["code"] == "engine_unavailable" and "exited unexpectedly" in error["message"]
    assert waiting.response.status_code == 503
    assert waiting.response.json()["error"]["code"] == "engine_unavailable"
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
    start = time.monotonic()
    late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=5)
    assert late.status_code == 503 and set(late.json()["error"]) == {"message", "type", "param", "code"}
    assert time.monotonic() - start < 1
    assert "baryon:engine_alive" in httpx.get(f"{server.url}/metrics", timeout=5).text
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(10) == 0


def test_killed_server_leaves_no_engine_behind(server):
    (engine,) = child_pids(server.process.pid)
    start = time.monotonic()
    server.process.kill()
    server.process.wait()
    wait_until_gone([engine], start + 5)
