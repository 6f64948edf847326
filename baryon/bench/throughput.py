"""Throughput of one `generate` call over a workload (BENCHMARKS.md):

- nano: 256 requests, input and output lengths uniform in [100, 1024] (random.Random(0), inputs
  drawn first, then outputs), temperature 0.6 — nano-vllm's bench.py workload;
- prefill: 16 requests x 2048-token prompts, 1 new token (prompt tokens/s).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from baryon.bench.common import add_engine_flags, build_llm, random_token_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baryon bench throughput", description=__doc__)
    parser.add_argument("--workload", choices=["nano", "prefill"], default="nano")
    parser.add_argument("--num-requests", type=int, default=None, help="default: 256 (nano) / 16 (prefill)")
    add_engine_flags(parser)
    return parser.parse_args(argv)


def workload(name: str, num_requests: int | None, vocab_size: int):
    from baryon.sampling_params import SamplingParams

    rng = random.Random(0)
    if name == "nano":
        n = num_requests or 256
        input_lens = [rng.randint(100, 1024) for _ in range(n)]
        output_lens = [rng.randint(100, 1024) for _ in range(n)]
        params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in output_lens]
    else:
        n = num_requests or 16
        input_lens = [2048] * n
        params = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)] * n
    return random_token_prompts(rng, input_lens, min(vocab_size, 10000)), params


def run(args: argparse.Namespace) -> dict:
    llm, startup = build_llm(args)
    vocab = llm.config.model.vocab_size
    prompts, params = workload(args.workload, args.num_requests, vocab)
    warm_prompts, warm_params = workload(args.workload, 4, vocab)
    llm.generate(warm_prompts, warm_params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "benchmark": "throughput", "workload": args.workload, "model": args.model, "requests": len(prompts),
        "device": str(llm.config.device), "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(output_tokens / elapsed, 1), "prompt_tok_s": round(prompt_tokens / elapsed, 1),
        "total_tok_s": round((prompt_tokens + output_tokens) / elapsed, 1), "startup_s": round(startup, 2),
        "kv_cache_tokens": llm.engine.core.num_kv_blocks * llm.config.cache.block_size,
    }


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
