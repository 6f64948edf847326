"""Speculative decoding on the GPU: the machinery's cost, measured with dummy weights.

Each phase runs in a fresh process and prints one JSON line per batch size; a table comes last.

- plain: decode without speculation (TPOT and step time), the reference.
- ngram: prompt lookup (k drafts) on random weights: what it costs when it rarely helps; plus the
  verify step alone: the runner's step with k drafts per request against a one-token decode step,
  on the same requests (host preparation, forward, rejection sampling and the read-back included).
- self: the target as its own draft model, greedy: every draft is accepted, so a step yields
  exactly k + 1 tokens; its step time includes the draft's catch-up and k - 1 draft steps.
- draft: plain decoding of the small draft preset (its step time prices a real draft).
- small-draft: the target with the small preset as its draft model (dummy weights: it accepts
  almost nothing): the measured step time of verification plus real drafting, against which the
  computed TPOT columns can be checked.

    python benchmarks/spec_decode.py --model qwen3-8b --draft qwen3-0.6b --k 4 --batch-sizes 1 8 64

The table adds, computed from the measured step times (labelled computed): the TPOT a draft of
the --draft preset's cost would give at acceptance rates 0.6 and 0.8 (expected tokens per step
(1 - a^(k+1)) / (1 - a); step = verify + k draft steps), and whether it beats plain decoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time

PHASES = ("plain", "ngram", "self", "draft", "small-draft")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--draft", default="qwen3-0.6b")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=129)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--dtype", default="auto", help="auto (the preset's, bf16) or float32: with float32 "
                        "the self-draft's argmax matches the target's (bf16 rounding differs between batch shapes)")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES[:4]))
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # run one phase in this process
    return parser.parse_args(argv)


def _llm(model: str, spec: dict | None, max_model_len: int, dtype: str):
    from baryon.bench.presets import resolve_model
    from baryon.llm import LLM

    if spec is not None and spec.get("model"):
        spec = dict(spec, model=resolve_model(spec["model"]))
    return LLM(model=resolve_model(model), load_format="dummy", skip_tokenizer_init=True, max_model_len=max_model_len, dtype=dtype,
               speculative_config=spec, engine_process=False)  # the verify-step timing drives the runner itself


def _tpot(llm, batch_size: int, input_len: int, output_len: int) -> dict:
    """Median over 3 runs of (time(output_len) - time(1)) / (output_len - 1), and per engine step."""
    from baryon.bench.latency import spec_summary
    from baryon.sampling_params import SamplingParams

    rng, high = random.Random(batch_size), min(llm.config.model.vocab_size, 10000)
    core = llm.engine.core

    def timed(max_tokens: int) -> tuple[float, int]:
        prompts = [{"prompt_token_ids": [rng.randrange(high) for _ in range(input_len)]} for _ in range(batch_size)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        steps, start = core.num_steps, time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, core.num_steps - steps

    timed(8)
    before = dataclasses.replace(core.spec_stats, accepted_per_position=list(core.spec_stats.accepted_per_position))
    tpots, steps = [], []
    for _ in range(3):
        first, first_steps = timed(1)
        full, full_steps = timed(output_len)
        tpots.append((full - first) / (output_len - 1))
        steps.append((full - first) / max(full_steps - first_steps, 1))
    spec = spec_summary(llm.config.speculative, before, core.spec_stats) if llm.config.speculative else {}
    return {"tpot_ms": round(statistics.median(tpots) * 1e3, 3), "step_ms": round(statistics.median(steps) * 1e3, 3),
            "draft_tokens": spec.get("num_draft_tokens", 0), "acceptance_rate": spec.get("acceptance_rate", 0.0),
            "tokens_per_verify": spec.get("mean_accepted_length") or 1.0}


def _verify_step(llm, batch_size: int, input_len: int, k: int) -> dict:
    """The runner's step with k drafts per request vs a one-token decode step, same requests
    (prefilled first); median of 50 of each."""
    import torch

    from baryon.request import Request
    from baryon.sampling_params import SamplingParams

    core, rng, high = llm.engine.core, random.Random(7), min(llm.config.model.vocab_size, 10000)
    requests = []
    for i in range(batch_size):
        prompt = [rng.randrange(high) for _ in range(input_len)]
        request = Request(f"verify-{i}", prompt, SamplingParams(temperature=0, max_tokens=64), frozenset(), 64)
        assert core.block_manager.allocate(request, input_len + k + 1)
        requests.append(request)
    core.runner.execute([(r, input_len) for r in requests])  # prefill
    for r in requests:
        r.num_computed_tokens = input_len
        r.append_output_token(rng.randrange(high))

    def timed(num_drafts: int) -> float:
        for r in requests:
            r.spec_token_ids = [rng.randrange(high) for _ in range(num_drafts)]
        times = []
        for _ in range(55):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            core.runner.execute([(r, 1 + num_drafts) for r in requests])
            times.append(time.perf_counter() - start)
        return statistics.median(times[5:])

    decode, verify = timed(0), timed(k)
    for r in requests:
        r.spec_token_ids = []
        core.block_manager.free(r)
    return {"decode_step_ms": round(decode * 1e3, 3), "verify_step_ms": round(verify * 1e3, 3),
            "verify_over_decode": round(verify / decode, 3)}


def run_phase(args: argparse.Namespace) -> None:
    k = args.k
    spec = {"plain": None, "draft": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": k},
            "self": {"method": "draft_model", "model": args.model, "num_speculative_tokens": k},
            "small-draft": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k}}[args.phase]
    model = args.draft if args.phase == "draft" else args.model
    start = time.perf_counter()
    llm = _llm(model, spec, args.max_model_len, args.dtype)
    startup = time.perf_counter() - start
    for bs in args.batch_sizes:
        result = {"phase": args.phase, "model": model, "dtype": args.dtype, "batch_size": bs, "k": k if spec else 0,
                  "startup_s": round(startup, 1), **_tpot(llm, bs, args.input_len, args.output_len)}
        if args.phase == "ngram":
            result.update(_verify_step(llm, bs, args.input_len, k))
        print(json.dumps(result), flush=True)


def _table(rows: list[dict], k: int) -> None:
    by = {(r["phase"], r["batch_size"]): r for r in rows}
    print(f"\n{'bs':>4} {'plain TPOT':>10} {'ngram TPOT':>10} {'(x plain)':>9} {'verify/decode':>13} "
          f"{'self tok/step':>13} {'self TPOT':>9} {'draft step':>10} {'a=0.6 TPOT*':>11} {'a=0.8 TPOT*':>11}")
    for bs in sorted({b for _, b in by}):
        plain, ngram, self_, draft = (by.get((p, bs), {}) for p in ("plain", "ngram", "self", "draft"))
        cells = [f"{bs:>4}", f"{plain.get('tpot_ms', float('nan')):>10.3f}", f"{ngram.get('tpot_ms', float('nan')):>10.3f}"]
        cells.append(f"{ngram.get('tpot_ms', float('nan')) / plain.get('tpot_ms', float('nan')):>9.3f}"
                     if plain and ngram else f"{'':>9}")
        cells.append(f"{ngram.get('verify_over_decode', float('nan')):>13.3f}")
        cells.append(f"{self_.get('tokens_per_verify', float('nan')):>13.3f}")
        cells.append(f"{self_.get('tpot_ms', float('nan')):>9.3f}")
        cells.append(f"{draft.get('step_ms', float('nan')):>10.3f}")
        for a in (0.6, 0.8):
            if ngram and draft:  # computed: verify step + k draft decode steps, expected tokens per step
                expected = (1 - a ** (k + 1)) / (1 - a)
                cells.append(f"{(ngram['verify_step_ms'] + k * draft['step_ms']) / expected:>11.3f}")
            else:
                cells.append(f"{'':>11}")
        print(" ".join(cells))
    print("* computed from measured step times: (verify step + k x draft decode step) / expected tokens per step")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.phase:
        run_phase(args)
        return
    rows = []
    for phase in args.phases:
        cmd = [sys.executable, __file__, "--phase", phase, "--model", args.model, "--draft", args.draft,
               "--k", str(args.k), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
               "--batch-sizes", *map(str, args.batch_sizes)]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=os.environ)
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                print(line, flush=True)
                rows.append(json.loads(line))
        if out.returncode:
            print(json.dumps({"phase": phase, "error": f"exit {out.returncode}"}), flush=True)
    _table(rows, args.k)


if __name__ == "__main__":
    main()
