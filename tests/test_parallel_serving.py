"""Several engine processes: a tensor-parallel worker that dies, data-parallel replicas, and the
server over both (CPU, gloo, two processes).

A killed worker must make the engine fail within seconds with an error that names it (offline:
WorkerDiedError; server: 503 on the request and on /health), never hang; shutdown leaves no
process behind. Data-parallel replicas give the same greedy tokens as one engine.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from baryon import LLM, SamplingParams
from baryon.distributed.worker_group import WorkerDiedError
from conftest import make_checkpoint, random_prompts
from test_server import ServerProcess, child_pids, pid_alive, post_concurrently


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("parallel_llama"), "llama", seed=5)


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def wait_until_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {[pid for pid in pids if pid_alive(pid)]}"
        time.sleep(0.05)


def test_killed_worker_fails_generation_within_seconds(llama_path, seed):
    llm = LLM(str(llama_path), tensor_parallel_size=2, device="cpu", skip_tokenizer_init=True)
    (worker,) = llm.engine.core.workers.processes
    engine = llm.engine
    for i, prompt in enumerate(random_prompts(3, 128, 4, 12, seed)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.has_unfinished_requests()
    worker.send_signal(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"tensor-parallel worker rank 1 .* killed by signal 9"):
        while engine.has_unfinished_requests():
            engine.step()
            assert time.monotonic() - start < 10, "the engine kept stepping without its worker"
    assert time.monotonic() - start < 10
    llm.shutdown()
    # A new engine can start in this process afterwards (the process group was released).
    with LLM(str(llama_path), tensor_parallel_size=2, device="cpu", skip_tokenizer_init=True) as again:
        out = again.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, temperature=0),
                             use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


def test_killed_dp_attention_replica_is_named(tmp_path, seed):
    """DP attention (two replicas sharing MoE experts, gloo on CPU): a replica killed mid-generation
    fails the engine within seconds, naming that replica as the cause, though its peer's exchange
    with it is what fails first."""
    from baryon.engine.core_processes import ReplicaFailedError

    path = make_checkpoint(tmp_path / "moe", "qwen3_moe", seed=seed % 2**31)
    llm = LLM(str(path), data_parallel_size=2, enable_expert_parallel=True, device="cpu", skip_tokenizer_init=True)
    try:
        engine = llm.engine
        for i, prompt in enumerate(random_prompts(4, 128, 4, 12, seed)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=300, ignore_eos=True))
        for _ in range(3):
            engine.step()
        assert engine.has_unfinished_requests()
        victim = engine.core.replicas[1]
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ReplicaFailedError, match=r"engine replica 1 exited unexpectedly \(exit code -9\)"):
            while engine.has_unfinished_requests():
                engine.step()
                assert time.monotonic() - start < 15, "the engine kept stepping without its replica"
    finally:
        llm.shutdown()


def test_worker_that_dies_before_joining_is_named(llama_path, tmp_path, monkeypatch):
    """A worker that exits at start-up (before the ranks meet) fails the engine within the join
    timeout, naming the worker, instead of leaving rank 0 waiting for the collective timeout."""
    from datetime import timedelta

    import baryon.distributed.parallel_state as parallel_state
    import baryon.distributed.worker_group as worker_group

    exits = tmp_path / "exits"
    exits.write_text("#!/bin/sh\nexit 3\n")
    exits.chmod(0o755)
    monkeypatch.setattr(parallel_state, "JOIN_TIMEOUT", timedelta(seconds=3))
    monkeypatch.setattr(worker_group.sys, "executable", str(exits))
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 .*exit(ed)? .*3"):
        LLM(str(llama_path), tensor_parallel_size=2, device="cpu", skip_tokenizer_init=True)
    assert time.monotonic() - start < 30


def test_worker_that_refuses_the_configuration_raises_its_error(llama_path, tmp_path, monkeypatch):
    """A worker that fails at start-up with a ValueError (a configuration it refuses, as every
    rank would) has that error raised by the engine, whatever rank 0 was doing when the worker's
    exit aborted the process group (CI once saw rank 0 report the missing process group)."""
    import sys
    from datetime import timedelta

    import baryon.distributed.parallel_state as parallel_state
    import baryon.distributed.worker_group as worker_group

    refuses = tmp_path / "refuses"
    refuses.write_text(f"#!{sys.executable}\nimport sys\nfrom baryon.distributed.worker_group import report_failure\n"
                       f"report_failure(sys.argv[6], ValueError('rank {{}} refuses this checkpoint'.format(sys.argv[3])))\n"
                       f"sys.exit(1)\n")
    refuses.chmod(0o755)
    monkeypatch.setattr(parallel_state, "JOIN_TIMEOUT", timedelta(seconds=3))
    monkeypatch.setattr(worker_group.sys, "executable", str(refuses))
    with pytest.raises(ValueError, match="^rank 1 refuses this checkpoint$"):
        LLM(str(llama_path), tensor_parallel_size=2, device="cpu", skip_tokenizer_init=True)


def test_shutdown_stops_every_worker(llama_path):
    llm = LLM(str(llama_path), tensor_parallel_size=2, device="cpu", skip_tokenizer_init=True)
    pids = [p.pid for p in llm.engine.core.workers.processes]
    assert all(pid_alive(pid) for pid in pids)
    llm.shutdown()
    wait_until_gone(pids, 10)


def test_shutdown_frees_graphs_before_the_process_group(llama_path, monkeypatch):
    """NCCL's teardown waits forever on a live CUDA graph that captured its collectives
    (pytorch#115388; seen on two H100s): the engine frees its graphs first."""
    import baryon.distributed.worker_group as worker_group

    llm = LLM(str(llama_path), tensor_parallel_size=2, device="cpu", skip_tokenizer_init=True)
    order = []
    runner = llm.engine.core.runner
    release = runner.release_cuda_graphs
    monkeypatch.setattr(runner, "release_cuda_graphs", lambda: (order.append("graphs"), release()))
    destroy = worker_group.destroy_distributed
    monkeypatch.setattr(worker_group, "destroy_distributed", lambda: (order.append("group"), destroy()))
    llm.shutdown()
    assert order == ["graphs", "group"]
    assert runner.graph_runner is None and runner.piecewise_runner is None


def test_replicas_are_loaded_by_tokens_not_by_requests(seed):
    """nano's 256 requests (prompts and outputs of 100-1,024 tokens, all at once) over two
    replicas: by tokens each holds half the work within one request's; a long request goes where
    the short ones are not; ending a request frees its tokens; no max_tokens counts the context."""
    import random

    from baryon.engine.replica_load import ReplicaLoad, request_tokens

    rng = random.Random(seed)
    load, work = ReplicaLoad(2), []
    for i in range(256):
        prompt, output = rng.randint(100, 1024), rng.randint(100, 1024)
        work.append(request_tokens(prompt, SamplingParams(max_tokens=output), 4096))
        load.assign(f"r{i}", work[-1])
    assert abs(load.tokens[0] - load.tokens[1]) <= max(work) and sum(load.tokens) == sum(work)
    for i in range(256):
        assert load.release(f"r{i}") in (0, 1)
    assert load.tokens == [0, 0] and len(load) == 0 and load.release("r0") is None
    assert load.assign("long", 5000) == 0 and load.assign("a", 100) == 1 and load.assign("b", 100) == 1
    assert load.replica_of("b") == 1 and "b" in load
    assert request_tokens(10, SamplingParams(max_tokens=None, n=2), 4096) == 2 * 4096


def test_data_parallel_replicas_match_one_engine(llama_path, seed):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 128, 3, 20, seed)]
    params = SamplingParams(max_tokens=6, temperature=0)
    with LLM(str(llama_path), device="cpu", skip_tokenizer_init=True) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM(str(llama_path), data_parallel_size=2, device="cpu", skip_tokenizer_init=True) as two:
        replicas = two.engine.core
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert not replicas.load and replicas.load.tokens == [0, 0]
        pids = [r.pid for r in replicas.replicas]
    assert got == expected
    wait_until_gone(pids, 10)


# -- the server -------------------------------------------------------------------------------

LONG_STREAM = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}


def assert_sigterm_stops_everything(server: ServerProcess) -> None:
    """SIGTERM: the server exits 0 and every process under it (engines, workers) is gone."""
    tree = [server.process.pid, *child_pids(server.process.pid)]
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(15) == 0
    wait_until_gone(tree, 10)


def stream_events(url: str, events: list[str], started: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG_STREAM, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    started.set()
    except httpx.HTTPError:
        pass
    finally:
        started.set()


def test_server_with_a_killed_worker_answers_503(stories_path):
    server = ServerProcess(stories_path, "--max-model-len", "512", "--tensor-parallel-size", "2")
    try:
        server.wait_ready()
        (engine,) = [pid for pid in child_pids(server.process.pid) if parent_pid(pid) == server.process.pid]
        workers = child_pids(engine)
        assert len(workers) == 1
        events, started = [], threading.Event()
        reader = threading.Thread(target=stream_events, args=(server.url, events, started), daemon=True)
        reader.start()
        assert started.wait(60) and events
        start = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        reader.join(10)
        assert not reader.is_alive() and time.monotonic() - start < 10
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "tensor-parallel worker rank 1" in error["message"]
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503
        assert_sigterm_stops_everything(server)
    finally:
        server.stop()


def test_server_balances_two_replicas(stories_path):
    server = ServerProcess(stories_path, "--max-model-len", "512", "--data-parallel-size", "2")
    try:
        server.wait_ready()
        assert len(child_pids(server.process.pid)) == 2  # one engine process per replica
        body = {"prompt": "The little dog", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        results = post_concurrently(server.url, "/v1/completions", [body] * 6)
        texts = {r["choices"][0]["text"] for r in results}
        assert len(texts) == 1  # the same greedy completion from either replica
        assert all(r["usage"]["completion_tokens"] == 12 for r in results)
        metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
        (total,) = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("baryon:kv_cache_total_blocks{")]
        # /metrics adds the replicas up: each sizes its CPU cache to 256 sequences of 512 tokens + 1 block.
        assert total == 2 * (256 * 512 // 16 + 1)
    finally:
        server.stop()


def test_server_stops_the_other_replicas_when_one_dies(stories_path):
    """A replica that dies fails the engine; the replicas left serve nothing more, so they are
    stopped too (asked, then killed: a DP-attention replica may be stuck waiting for the dead
    one), and the server answers 503 until it is restarted."""
    server = ServerProcess(stories_path, "--max-model-len", "512", "--data-parallel-size", "2")
    try:
        server.wait_ready()
        replicas = [pid for pid in child_pids(server.process.pid) if parent_pid(pid) == server.process.pid]
        assert len(replicas) == 2
        os.kill(replicas[0], signal.SIGKILL)
        wait_until_gone(replicas, 15)
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
        assert "exited unexpectedly" in health.json()["error"]["message"]
        late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=5)
        assert late.status_code == 503
        assert_sigterm_stops_everything(server)
    finally:
        server.stop()
