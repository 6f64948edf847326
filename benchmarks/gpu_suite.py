"""Run the GPU workloads of BENCHMARKS.md for each model, each in a fresh process, and print a
short table last (each benchmark's JSON line is printed as it finishes).

    python benchmarks/gpu_suite.py --models qwen3-0.6b qwen3-8b [--workloads latency-bs1 ...] [-- engine flags]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

WORKLOADS = {
    "latency-bs1": ["baryon.bench.latency", "--batch-size", "1"],
    "decode-bs64": ["baryon.bench.latency", "--batch-size", "64"],
    "nano": ["baryon.bench.throughput", "--workload", "nano"],
    "prefill": ["baryon.bench.throughput", "--workload", "prefill"],
}


def run_one(model: str, workload: str, extra: list[str], timeout: int) -> dict:
    module, *flags = WORKLOADS[workload]
    cmd = [sys.executable, "-m", module, "--model", model, *flags, *extra]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "workload": workload, "error": f"timed out after {timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"model": model, "workload": workload, "error": proc.stderr.strip().splitlines()[-1:]}
    result = json.loads(lines[-1])
    result["workload"] = workload
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per benchmark process")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    results = []
    for model in args.models:
        for workload in args.workloads:
            result = run_one(model, workload, extra, args.timeout)
            print(json.dumps(result), flush=True)
            results.append(result)
    print(f"\n{'model':<12} {'workload':<12} {'figure':<34} {'startup':>8}")
    for r in results:
        if "error" in r:
            figure = f"error: {r['error']}"
        elif r["benchmark"] == "latency":
            figure = f"TPOT {r['tpot_ms']:.3f} ms, TTFT {r['ttft_ms']:.1f} ms"
        elif r["workload"] == "prefill":
            figure = f"{r['prompt_tok_s']:,.0f} prompt tok/s"
        else:
            figure = f"{r['output_tok_s']:,.0f} out tok/s ({r['total_tok_s']:,.0f} total)"
        startup = f"{r['startup_s']:.1f} s" if "startup_s" in r else "-"
        print(f"{r['model']:<12} {r['workload']:<12} {figure:<34} {startup:>8}")


if __name__ == "__main__":
    main()
