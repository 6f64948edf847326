"""Latency: TTFT and time per output token (TPOT) of a batch of identical-length requests.

TPOT = (time to generate output_len tokens - time to generate 1 token) / (output_len - 1),
median over --num-iters runs (the latency-bs1 and decode-bs64 workloads of BENCHMARKS.md).
step_ms is the same difference per engine step; with --speculative-config a step verifies each
request's drafts (step_ms: the verify step, drafting included), and the JSON adds the acceptance.
"""

from __future__ import annotations

import argparse
import dataclasses
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

    core = llm.engine.core

    def timed(max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        steps, start = core.num_steps, time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, core.num_steps - steps

    timed(8)  # warm-up
    spec_before = dataclasses.replace(core.spec_stats, accepted_per_position=list(core.spec_stats.accepted_per_position))
    ttfts, tpots, step_times = [], [], []
    for _ in range(args.num_iters):
        # Prefix caching would serve the repeated prompts from cache: vary the first token.
        for p in prompts:
            p["prompt_token_ids"][0] = (p["prompt_token_ids"][0] + 1) % min(vocab, 10000)
        first, first_steps = timed(1)
        for p in prompts:
            p["prompt_token_ids"][0] = (p["prompt_token_ids"][0] + 1) % min(vocab, 10000)
        full, full_steps = timed(args.output_len)
        ttfts.append(first)
        tpots.append((full - first) / (args.output_len - 1))
        step_times.append((full - first) / max(full_steps - first_steps, 1))
    result = {
        "benchmark": "latency", "model": args.model, "batch_size": args.batch_size,
        "input_len": args.input_len, "output_len": args.output_len, "dtype": str(llm.config.model.dtype).split(".")[-1],
        "device": str(llm.config.device), "ttft_ms": round(statistics.median(ttfts) * 1e3, 3),
        "tpot_ms": round(statistics.median(tpots) * 1e3, 3), "step_ms": round(statistics.median(step_times) * 1e3, 3),
        "startup_s": round(startup, 2),
    }
    if llm.config.speculative is not None:
        result["speculative"] = spec_summary(llm.config.speculative, spec_before, core.spec_stats)
    return result


def spec_summary(spec, before, after) -> dict:
    """Acceptance over the timed runs (after - before: totals of the engine's SpecDecodeStats)."""
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
        "mean_accepted_length": round(1 + accepted / drafts, 4) if drafts else 0.0,
        "accepted_per_position": [a - b for a, b in zip(after.accepted_per_position, before.accepted_per_position)],
    }


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
