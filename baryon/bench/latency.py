"""Latency: TTFT and time per output token (TPOT) of a batch of identical-length requests.

TPOT = (time to generate output_len tokens - time to generate 1 token) / (output_len - 1),
median over --num-iters runs (the latency-bs1 and decode-bs64 workloads of BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from baryon.bench.common import add_engine_flags, build_llm, random_token_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baryon bench latency", description=__doc__)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=257, help="new tokens per request (TPOT spans all but the first)")
    parser.add_argument("--num-iters", type=int, default=3)
    add_engine_flags(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    from baryon.sampling_params import SamplingParams

    llm, startup = build_llm(args)
    vocab = llm.config.model.vocab_size
    prompts = random_token_prompts(random.Random(0), [args.input_len] * args.batch_size, min(vocab, 10000))

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    timed(8)  # warm-up
    ttfts, tpots = [], []
    for _ in range(args.num_iters):
        # Prefix caching would serve the repeated prompts from cache: vary the first token.
        for p in prompts:
            p["prompt_token_ids"][0] = (p["prompt_token_ids"][0] + 1) % min(vocab, 10000)
        first = timed(1)
        for p in prompts:
            p["prompt_token_ids"][0] = (p["prompt_token_ids"][0] + 1) % min(vocab, 10000)
        full = timed(args.output_len)
        ttfts.append(first)
        tpots.append((full - first) / (args.output_len - 1))
    return {
        "benchmark": "latency", "model": args.model, "batch_size": args.batch_size,
        "input_len": args.input_len, "output_len": args.output_len, "dtype": str(llm.config.model.dtype).split(".")[-1],
        "device": str(llm.config.device), "ttft_ms": round(statistics.median(ttfts) * 1e3, 3),
        "tpot_ms": round(statistics.median(tpots) * 1e3, 3), "startup_s": round(startup, 2),
    }


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
