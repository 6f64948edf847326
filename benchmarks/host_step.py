"""Where a decode step's host time goes: the engine's phases timed per step, with and without a
JSON-schema constraint on every request.

    python benchmarks/host_step.py --model qwen3-0.6b --batch 64 --steps 256 --rounds 3
    python benchmarks/host_step.py --model qwen3-8b --batch 64 --cases unconstrained --tensor-parallel-size 2
    python benchmarks/host_step.py --tiny --batch 64 --steps 128 --rounds 3      # a CPU: the host's own work

Builds the preset as `benchmarks/structured_output.py` does (dummy weights, a byte-level
tokenizer of the preset's vocabulary size, so grammars and detokenizing run as with a real one),
then runs `--rounds` alternating rounds of `--batch` requests of `--steps` tokens, unconstrained
and under the structured-output benchmark's enum-array schema. Each phase is timed by wrapping
its method: `EngineCore.step` (one step of the engine loop, launch and read-back),
`ModelRunner.launch` (planning, uploading and queueing a step, and with a grammar the deferred
sampling of the one before), `LaunchedStep.result` (waiting for a step's samples: time the GPU is
behind), `EngineCore._update` (the read-back applied to the requests), `Scheduler.schedule`.
Output processing and detokenizing are what a token costs beyond `EngineCore.step`.

`--tiny` replaces the preset with a 1-layer Qwen3 of hidden size 32 and random weights over a
2,048-token byte-level vocabulary, on the CPU: its forward pass takes little, so a step's time is
mostly the engine's and the grammar's host work (what a host-bound GPU step pays).

Prints one JSON line per (round, case): ms per token and each phase's median ms per call; a
table of the medians over rounds last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from structured_output import byte_level_tokenizer, enum_array_spec, synthetic_vocab

TINY_VOCAB = 2048


def tiny_checkpoint(folder: Path) -> Path:
    """A 1-layer Qwen3 of hidden size 32 with random weights (transformers' save_pretrained)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                         eos_token_id=0, tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


PHASES = ("EngineCore.step", "ModelRunner.launch", "LaunchedStep.result", "EngineCore._update", "Scheduler.schedule")


def time_phases() -> dict[str, list[float]]:
    """Wrap each phase's method so that every call appends its duration (seconds)."""
    from baryon.engine.core import EngineCore
    from baryon.engine.scheduler import Scheduler
    from baryon.runner.model_runner import LaunchedStep, ModelRunner

    owners = {"EngineCore": EngineCore, "ModelRunner": ModelRunner, "LaunchedStep": LaunchedStep,
              "Scheduler": Scheduler}
    times: dict[str, list[float]] = {}
    for phase in PHASES:
        owner, name = phase.split(".")
        cls = owners[owner]
        original = getattr(cls, name)
        times[phase] = calls = []

        def timed(*args, _original=original, _calls=calls, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _calls.append(time.perf_counter() - start)
        setattr(cls, name, timed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a preset (dummy weights)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks > 0 run in worker processes; the phases are rank 0's")
    parser.add_argument("--cases", choices=("both", "unconstrained", "json"), default="both",
                        help="which cases to run (one alone: for a sampling profiler run over this script)")
    parser.add_argument("--tiny", action="store_true",
                        help="a 1-layer Qwen3 of hidden 32 on the CPU instead of --model (the host's own work)")
    args = parser.parse_args()
    from baryon import LLM, SamplingParams
    from baryon.bench.presets import PRESETS, resolve_model

    name = "tiny" if args.tiny else args.model
    folder = Path(tempfile.mkdtemp(prefix="host-step-"))
    vocab_size, eos = (TINY_VOCAB, 0) if args.tiny else (PRESETS[args.model]["vocab_size"],
                                                         PRESETS[args.model]["eos_token_id"])
    tokenizer = byte_level_tokenizer(folder / "tokenizer", synthetic_vocab(vocab_size, 0), eos)
    # The phases are timed by wrapping the engine's methods, so the engine core runs in this process
    # (the offline API's default on a GPU puts it in a process of its own).
    model = dict(model=str(tiny_checkpoint(folder / "tiny")), device="cpu", dtype="float32") if args.tiny else \
        dict(model=resolve_model(args.model), load_format="dummy")
    llm = LLM(**model, tokenizer=str(tokenizer), max_model_len=4096, engine_process=False,
              tensor_parallel_size=args.tensor_parallel_size)
    times = time_phases()
    cases = {"unconstrained": None, "json schema": enum_array_spec()}
    if args.cases != "both":
        cases = {case: spec for case, spec in cases.items() if case.startswith(args.cases)}

    def run(structured, tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=structured)
        start = time.perf_counter()
        llm.generate(["Once upon a time"] * args.batch, params, use_tqdm=False)
        return time.perf_counter() - start

    for structured in cases.values():
        run(structured, 4)  # compile and warm up
    records = []
    for round_ in range(args.rounds):
        for case, structured in cases.items():
            for calls in times.values():
                calls.clear()
            elapsed = run(structured, args.steps)
            record = {"round": round_, "case": case, "model": name, "batch": args.batch,
                      "ms_per_token": elapsed / args.steps * 1e3}
            record.update({phase: statistics.median(calls) * 1e3 for phase, calls in times.items() if calls})
            records.append(record)
            print(json.dumps(record), flush=True)
    print(f"\nmedians over {args.rounds} rounds, ms ({name}, batch {args.batch}, {args.steps} tokens)")
    print(f"{'case':<14} {'per token':>9} " + " ".join(f"{p:>20}" for p in PHASES))
    for case in cases:
        rows = [r for r in records if r["case"] == case]
        cells = [statistics.median(r.get(p, float("nan")) for r in rows) for p in PHASES]
        print(f"{case:<14} {statistics.median(r['ms_per_token'] for r in rows):>9.3f} "
              + " ".join(f"{c:>20.3f}" for c in cells))


if __name__ == "__main__":
    main()
