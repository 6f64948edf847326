"""A long prompt arriving while other requests decode: its TTFT against their inter-token latency.

The token budget (`--max-num-batched-tokens`) decides how a long prompt is cut into chunks: a
large budget prefills it in few steps (its TTFT falls), but every step that carries a chunk is a
long pause for the requests that are decoding beside it (their inter-token latency rises). This
measures both for one budget, so that a sweep over budgets shows the trade-off (issue 19 item 3):

    python -m baryon.bench.prefill_beside_decodes --model qwen3-8b --input-len 16384 --decodes 16 \
        --max-num-batched-tokens 4096

`--decodes` requests (128-token prompts) decode first; their steady step time is `itl_ms`. Then a
fresh `--input-len`-token prompt arrives (one output token): `ttft_ms` is from its arrival to its
token, and `itl_during_ms` / `itl_max_ms` are the mean and the longest step the decoders waited
while it was prefilled (`prefill_steps` steps). Medians over `--num-iters` arrivals (each prompt differs, so nothing is
served from the prefix cache).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from baryon.bench.common import add_engine_flags, build_llm, random_token_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m baryon.bench.prefill_beside_decodes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=16384, help="tokens of the arriving prompt")
    parser.add_argument("--decodes", type=int, default=16, help="requests decoding when it arrives")
    parser.add_argument("--steady-steps", type=int, default=16, help="decode steps timed before each arrival")
    parser.add_argument("--num-iters", type=int, default=3)
    add_engine_flags(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    from baryon.sampling_params import SamplingParams

    llm, startup = build_llm(args)
    engine = llm.engine
    high = min(llm.config.model.vocab_size, 10000)
    rng = random.Random(0)
    # The decoders must outlast every arrival's prefill: at least one token per step.
    steps_per_arrival = args.steady_steps + 2 * (-(-args.input_len // max(llm.config.scheduler.max_num_batched_tokens
                                                                           - args.decodes, 1))) + 4
    budget = args.num_iters * steps_per_arrival + 8
    decode_params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    for i, prompt in enumerate(random_token_prompts(rng, [128] * args.decodes, high)):
        engine.add_request(f"decode-{i}", prompt, decode_params)
    started = set()
    while len(started) < args.decodes:  # every decoder past its prompt
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    ttfts, itls, during, longest, counts = [], [], [], [], []
    for it in range(args.num_iters):
        steady = []
        for _ in range(args.steady_steps):
            t0 = time.perf_counter()
            engine.step()
            steady.append(time.perf_counter() - t0)
        long_id = f"long-{it}"
        arrival = time.perf_counter()
        engine.add_request(long_id, random_token_prompts(rng, [args.input_len], high)[0],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        steps, done = [], False
        while not done:
            t0 = time.perf_counter()
            outputs = engine.step()
            steps.append(time.perf_counter() - t0)
            done = any(o.request_id == long_id and o.finished for o in outputs)
        ttfts.append(time.perf_counter() - arrival)
        itls.append(statistics.median(steady))
        during.append(statistics.mean(steps))
        longest.append(max(steps))
        counts.append(len(steps))
    engine.abort_request([f"decode-{i}" for i in range(args.decodes)])
    return {
        "benchmark": "prefill_beside_decodes", "model": args.model, "input_len": args.input_len,
        "decodes": args.decodes, "max_num_batched_tokens": llm.config.scheduler.max_num_batched_tokens,
        "ttft_ms": round(statistics.median(ttfts) * 1e3, 2), "itl_ms": round(statistics.median(itls) * 1e3, 3),
        "itl_during_ms": round(statistics.median(during) * 1e3, 3),
        "itl_max_ms": round(statistics.median(longest) * 1e3, 3), "prefill_steps": statistics.median(counts),
        "startup_s": round(startup, 2),
    }


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
