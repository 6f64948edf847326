"""Run the GPU workloads of BENCHMARKS.md for each model, each in a fresh process, and print a
short table last (each benchmark's JSON line is printed as it finishes).

The serve workload starts `baryon serve` on the preset (dummy weights, synthetic tokenizer),
waits for /health, runs `baryon.bench.serve` (500 requests, 1024 tokens in, 128 out, at most 64
in flight) and stops the server with SIGTERM.

    python benchmarks/gpu_suite.py --models qwen3-0.6b qwen3-8b [--workloads latency-bs1 ...] [-- engine flags]
    python benchmarks/gpu_suite.py --models qwen3-8b --variants bf16 "fp8:--quantization fp8" \
        "w4a16:--quantization w4a16" "fp8kv:--kv-cache-dtype fp8 --kv-cache-memory-gib 4.5"

`--log-dir DIR` keeps every benchmark process's whole output (with BARYON_LOG_LEVEL=INFO, the
engine's start-up lines: how long loading and each graph capture took); on the device machine
`--log-dir $OUT/logs` brings them back even when the call is cut short.

A variant is NAME[@TREE][:[VAR=VALUE ...] ENGINE FLAGS]: each model runs once per variant,
labelled model/NAME; its leading VAR=VALUE words are environment variables of its processes (a
kernel forced by BARYON_KERNEL_<FAMILY>=name, say); with @TREE its processes import baryon from
the folder TREE (an older tree unpacked there, say by `git archive COMMIT baryon | tar -x -C
before`), for A/B runs on one machine. `--repeats N` runs the whole list N times in turn (A, B,
A, B, ...: a host's drift falls on both alike) and prints each variant's median last.

    python benchmarks/gpu_suite.py --models qwen3-30b-a3b --workloads nano --repeats 3 \
        --variants "after:--data-parallel-size 2 --enable-expert-parallel" \
        "before@before:--data-parallel-size 2 --enable-expert-parallel" "tp1:"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

WORKLOADS = {
    "latency-bs1": ["baryon.bench.latency", "--batch-size", "1"],
    "decode-bs64": ["baryon.bench.latency", "--batch-size", "64"],
    "latency-16k": ["baryon.bench.latency", "--batch-size", "1", "--input-len", "16384", "--output-len", "129",
                    "--max-model-len", "16640"],  # issue 19: a fresh 16k prompt, then 128 tokens
    # Past the native window (issue 19 item 4): presets llama-3.1-8b, qwen3-8b-yarn
    # (128k: a prompt of 130,816 tokens, so that it and its 129 new tokens fit the models' 131,072)
    **{name: ["baryon.bench.latency", "--batch-size", "1", "--input-len", str(n), "--output-len", "129",
              "--max-model-len", str(min(n + 256, 131072)), "--num-iters", "1"]
       for name, n in (("latency-32k", 32768), ("latency-64k", 65536), ("latency-128k", 131072 - 256))},
    # Issue 19 item 3: a long prompt arriving while 16 requests decode; sweep the token budget
    # with --variants "b2k:--max-num-batched-tokens 2048" "b8k:--max-num-batched-tokens 8192" ...
    **{name: ["baryon.bench.prefill_beside_decodes", "--input-len", str(n), "--decodes", "16",
              "--max-model-len", str(n + 1024)]
       for name, n in (("beside-16k", 16384), ("beside-64k", 65536))},
    "nano": ["baryon.bench.throughput", "--workload", "nano"],
    "prefill": ["baryon.bench.throughput", "--workload", "prefill"],
    "serve": ["baryon.bench.serve", "--num-prompts", "500", "--random-input-len", "1024",
              "--random-output-len", "128", "--max-concurrency", "64", "--port", "8123"],
}


def start_server(model: str, extra: list[str], timeout: int, process: dict) -> subprocess.Popen:
    from baryon.bench.presets import PRESETS, resolve_model

    cmd = [sys.executable, "-m", "baryon.cli", "serve", resolve_model(model), "--port", "8123",
           "--uvicorn-log-level", "warning", *extra]
    if model in PRESETS:  # random weights; the context length of the other workloads
        cmd += ["--load-format", "dummy", "--max-model-len", "4096"]
    server = launch(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **process)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen("http://127.0.0.1:8123/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(1)
    kill_run(server)
    raise RuntimeError("the server did not come up")


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    kill_run(server)


# Every process a benchmark starts inherits this variable with the run's own value, so the suite
# finds them all even after their parent died (an orphaned tensor-parallel worker is reparented,
# and the engine-core processes run in sessions of their own).
_MARK = "BARYON_GPU_SUITE_RUN"
# The benchmark (and server) processes running now, each with its mark: each runs in a session of
# its own, so a signal to the suite's process group does not reach them; the suite kills them
# when it is killed.
_RUNNING: dict[subprocess.Popen, str] = {}


def _stop_running(signum, frame) -> None:
    for process in list(_RUNNING):
        kill_run(process)
    sys.exit(128 + signum)


def launch(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Popen in a session of its own, marked (see _MARK) and counted as running."""
    mark = uuid.uuid4().hex
    env = dict(kwargs.pop("env", None) or os.environ)
    env[_MARK] = mark
    process = subprocess.Popen(cmd, start_new_session=True, env=env, **kwargs)
    _RUNNING[process] = mark
    return process


def marked(process: subprocess.Popen) -> list[int]:
    """The benchmark process and every live process started under it (by their environment)."""
    if process not in _RUNNING:  # killed already
        return []
    mark = f"{_MARK}={_RUNNING[process]}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def kill_run(process: subprocess.Popen) -> None:
    """Kill a benchmark process with every process it started (engine processes, DP replicas,
    tensor-parallel workers), so that none is left holding a GPU's memory for the next variant."""
    for pid in {process.pid, *marked(process)}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    _RUNNING.pop(process, None)


def dump_stacks(process: subprocess.Popen) -> None:
    """SIGUSR1 to the benchmark and every process under it that handles it: each baryon process
    prints its threads' Python stacks to stderr (baryon.logger.dump_stacks_on_sigusr1). Others
    (one still importing, a compiler) are left alone: SIGUSR1 would end them."""
    for pid in marked(process):
        try:
            with open(f"/proc/{pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
            if caught >> (signal.SIGUSR1 - 1) & 1:
                os.kill(pid, signal.SIGUSR1)
        except (OSError, StopIteration):
            pass


def tree_process(tree: str, variables: dict[str, str] | None = None) -> dict:
    """subprocess arguments that make a variant's processes import baryon from `tree` ({}: this
    one) with these environment variables set. The folder is their working directory too: `python
    -m` puts that first on sys.path, ahead of PYTHONPATH, so from the repository's root its own
    baryon would be imported."""
    if not tree and not variables:
        return {}
    env = {**os.environ, **(variables or {})}
    if not tree:
        return {"env": env}
    tree = os.path.abspath(tree)
    if not os.path.isdir(os.path.join(tree, "baryon")):
        raise SystemExit(f"variant tree {tree!r} has no baryon/ folder")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    return {"env": env, "cwd": tree}


def variant_settings(flags: str) -> tuple[dict[str, str], list[str]]:
    """A variant's FLAGS: its leading NAME=VALUE words (environment variables, as
    BARYON_KERNEL_ALL_REDUCE=symm_mem_pushed) and the engine flags after them, split at white space
    (a JSON value is one word without quotes around it: --hf-overrides {"num_hidden_layers":4})."""
    words = flags.split()
    variables = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        variables[name] = value
    return variables, words


def run_one(model: str, workload: str, extra: list[str], timeout: int, process: dict | None = None,
            log_path: str | None = None, stack_dump_after: int | None = None) -> dict:
    """One benchmark process (process: subprocess arguments of a variant's tree, tree_process;
    log_path: where its whole stdout and stderr go too; stack_dump_after: seconds after which a
    process still running gets SIGUSR1, so that its processes print their Python stacks)."""
    process = process or {}
    module, *flags = WORKLOADS[workload]
    server = None
    if workload == "serve":
        try:
            server = start_server(model, extra, timeout, process)
        except RuntimeError as e:
            return {"model": model, "workload": workload, "error": str(e)}
        cmd = [sys.executable, "-m", module, *flags]
    else:
        cmd = [sys.executable, "-m", module, "--model", model, *flags, *extra]
    # Output to files, not pipes: a process the benchmark left behind (an orphaned worker) would
    # hold a pipe open, and reading it to its end would wait for that process.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = launch(cmd, stdout=out, stderr=err, text=True, **process)
        timed_out = False
        try:
            if stack_dump_after is not None:
                try:
                    proc.wait(timeout=stack_dump_after)
                except subprocess.TimeoutExpired:  # still running: every baryon process prints its stacks
                    dump_stacks(proc)
                    proc.wait(timeout=timeout - stack_dump_after)
            else:
                proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_run(proc)  # and what the benchmark left running
            if server is not None:
                stop_server(server)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            if log_path is not None:
                with open(log_path, "w") as log:
                    log.write(f"$ {' '.join(cmd)}\n{stdout}\n--- stderr ---\n{stderr}")
    if timed_out:
        return {"model": model, "workload": workload, "error": f"timed out after {timeout} s",
                "stderr_tail": stderr.strip().splitlines()[-5:]}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"model": model, "workload": workload, "error": stderr.strip().splitlines()[-1:]}
    result = json.loads(lines[-1])
    result.update(workload=workload, model=model)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    # The serve workload's server reads this too: keep it quiet.
    os.environ.setdefault("BARYON_LOG_LEVEL", "WARNING")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per benchmark process")
    parser.add_argument("--variants", nargs="+", default=[""],
                        help="NAME[@TREE][:ENGINE FLAGS] each: run every model once per variant")
    parser.add_argument("--repeats", type=int, default=1, help="run the whole list this many times in turn")
    parser.add_argument("--log-dir", default=None,
                        help="keep each benchmark process's output in DIR/<model>-<variant>-<workload>-<repeat>.log "
                             "(on the device: $OUT/logs; BARYON_LOG_LEVEL=INFO for the engine's start-up lines)")
    parser.add_argument("--stack-dump-after", type=int, default=None,
                        help="seconds: a benchmark still running then gets SIGUSR1 in its whole process group, "
                             "and every baryon process prints its threads' stacks to stderr (see --log-dir)")
    args, extra = parser.parse_known_args()
    if args.stack_dump_after is not None and not 0 < args.stack_dump_after < args.timeout:
        parser.error(f"--stack-dump-after {args.stack_dump_after} must be between 0 and --timeout ({args.timeout}) "
                     f"seconds: a run is killed at --timeout")
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a call cut short: leave no GPU held
        signal.signal(signum, _stop_running)
    extra = [a for a in extra if a != "--"]
    variants = []
    for variant in args.variants:
        head, _, flags = variant.partition(":")
        name, _, tree = head.partition("@")
        variables, engine_flags = variant_settings(flags)
        variants.append((name, tree_process(tree, variables), engine_flags))
    results = []
    for repeat in range(args.repeats):
        for model in args.models:
            for name, process, flags in variants:
                for workload in args.workloads:
                    log_path = None
                    if args.log_dir:
                        os.makedirs(args.log_dir, exist_ok=True)
                        label = os.path.basename(model.rstrip("/"))  # a preset, or a checkpoint folder's name
                        log_path = os.path.join(args.log_dir, f"{label}-{name or 'default'}-{workload}-{repeat}.log")
                    result = run_one(model, workload, extra + flags, args.timeout, process, log_path,
                                     args.stack_dump_after)
                    result["model"] = f"{model}/{name}" if name else model
                    result["repeat"] = repeat
                    print(json.dumps(result), flush=True)
                    results.append(result)
    print_table(results)
    if args.repeats > 1:
        print_medians(results)


def headline(r: dict) -> tuple[float, str] | None:
    """A result's main figure and its unit (None for an error)."""
    if "error" in r:
        return None
    if r["benchmark"] == "latency":
        return r["tpot_ms"], "ms TPOT"
    if r["benchmark"] == "prefill_beside_decodes":
        return r["itl_during_ms"], "ms ITL during"
    if r["workload"] == "serve":
        return r["output_throughput"], "out tok/s"
    if r["workload"] == "prefill":
        return r["prompt_tok_s"], "prompt tok/s"
    return r["output_tok_s"], "out tok/s"


def print_medians(results: list[dict]) -> None:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["model"], r["workload"]), []).append(r)
    print(f"\n{'model':<20} {'workload':<12} {'median':>12} {'unit':<14} runs")
    for (model, workload), runs in groups.items():
        figures = [h for h in map(headline, runs) if h is not None]
        if not figures:
            print(f"{model:<20} {workload:<12} {'-':>12} {'':<14} every run failed")
            continue
        values = [v for v, _ in figures]
        print(f"{model:<20} {workload:<12} {statistics.median(values):>12,.3f} {figures[0][1]:<14} "
              f"{', '.join(f'{v:,.3f}' for v in values)}")


def print_table(results: list[dict]) -> None:
    print(f"\n{'model':<20} {'workload':<12} {'figure':<34} {'startup':>8}")
    for r in results:
        if "error" in r:
            figure = f"error: {r['error']}"
        elif r["benchmark"] == "latency":
            figure = f"TPOT {r['tpot_ms']:.3f} ms, TTFT {r['ttft_ms']:.1f} ms"
        elif r["benchmark"] == "prefill_beside_decodes":
            figure = (f"TTFT {r['ttft_ms']:.0f} ms, ITL {r['itl_ms']:.2f} -> {r['itl_during_ms']:.2f} "
                      f"(max {r['itl_max_ms']:.1f}) ms")
        elif r["workload"] == "serve":
            figure = (f"{r['output_throughput']:,.0f} out tok/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                      f"TPOT p50 {r['median_tpot_ms']:.1f} ms, ITL p99 {r['p99_itl_ms']:.1f} ms")
        elif r["workload"] == "prefill":
            figure = f"{r['prompt_tok_s']:,.0f} prompt tok/s"
        else:
            figure = f"{r['output_tok_s']:,.0f} out tok/s ({r['total_tok_s']:,.0f} total)"
        startup = f"{r['startup_s']:.1f} s" if "startup_s" in r else "-"
        if "kv_cache_tokens" in r:
            figure += f", KV {r['kv_cache_tokens']:,} tok"
        print(f"{r['model']:<20} {r['workload']:<12} {figure:<34} {startup:>8}")


if __name__ == "__main__":
    main()
