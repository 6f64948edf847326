"""Structured outputs: what a JSON-schema constraint costs, piece by piece and end to end.

    python benchmarks/structured_output.py                     # CPU: host costs + stories260K decode
    python benchmarks/structured_output.py --model qwen3-8b --batch 64   # GPU: a preset, dummy weights

1. compile: a 20-field JSON schema compiled against a 151,936-token byte-level vocabulary (Qwen3's
   size; synthetic printable tokens, since no real tokenizer is downloadable offline), cold and
   cached (GrammarCompiler.submit, as the engine calls it);
2. fill: one decode step's host work for B constrained requests (each matcher accepts one token,
   then the batch's bitmask is filled), at B = 1 and 64, walking the grammar with random allowed
   tokens;
3. apply: the token_bitmask kernel on [B, 151936] float32 logits on the device;
4. decode: TPOT of `--model` at batch 1 and `--batch` (median of --repeats, the two cases
   alternating), every request under the same schema against no constraint. A preset (dummy
   weights; its own synthetic tokenizer has no JSON characters) runs with a byte-level
   tokenizer over step 1's kind of vocabulary, at the preset's vocabulary size. The last lines
   also give the median of each repeat's paired ratio (its constrained run over the unconstrained
   run just before), which a host whose speed drifts between repeats moves less.

Prints one JSON line per measurement and a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

VOCAB = 151_936
STORIES = Path(os.environ.get(  # as the tests find it: BARYON_STORIES_PATH, else ../shared/models
    "BARYON_STORIES_PATH", Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"))


def twenty_field_schema() -> dict:
    kinds = [{"type": "string", "pattern": "^[a-z]{1,12}$"}, {"type": "integer", "minimum": 0, "maximum": 10_000},
             {"type": "boolean"}, {"enum": ["low", "medium", "high"]},
             {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4}]
    properties = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def synthetic_vocab(size: int, seed: int) -> list[bytes]:
    """256 byte tokens, then printable strings of 2-8 characters (words, punctuation, spaces)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 {}[]\":,._-\n"
    vocab, seen = [bytes([b]) for b in range(256)], set()
    while len(vocab) < size:
        token = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))).encode()
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    return vocab


def byte_level_tokenizer(folder: Path, vocab: list[bytes], eos_token_id: int) -> Path:
    """A Hugging Face byte-level BPE tokenizer whose token i is vocab[i] (no merges: text encodes
    byte by byte, and every token decodes), so that a preset's grammar sees a vocabulary of its
    model's size and kind. (A small real tokenizer padded to 151,936 ids would not do: xgrammar
    treats the padding ids as special tokens and scans them on every accepted token.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_unicode = bytes_to_unicode()
    pieces = ["".join(to_unicode[b] for b in token) for token in vocab]
    tokenizer = Tokenizer(models.BPE({piece: i for i, piece in enumerate(pieces)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=pieces[eos_token_id])
    fast.save_pretrained(folder)
    return folder


def host_costs(records: list[dict], seed: int, steps: int) -> None:
    import xgrammar as xgr

    from baryon.sampling_params import StructuredOutputsParams
    from baryon.structured_output.compiler import COMPILER_THREADS
    from baryon.structured_output.grammar import compile_spec
    from baryon.structured_output.matcher import batch_matcher

    info = xgr.TokenizerInfo(synthetic_vocab(VOCAB, seed), xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS)
    spec = StructuredOutputsParams(json=twenty_field_schema(), disable_any_whitespace=True)
    start = time.perf_counter()
    compiled = compile_spec(compiler, spec)
    records.append({"measure": "compile", "case": "20 fields, cold", "ms": (time.perf_counter() - start) * 1e3})
    start = time.perf_counter()
    compile_spec(compiler, spec)
    records.append({"measure": "compile", "case": "20 fields, cached", "ms": (time.perf_counter() - start) * 1e3})
    rng = random.Random(seed)
    for batch in (1, 64):
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        bitmask = xgr.allocate_token_bitmask(batch, VOCAB)
        times, tokens = [], [None] * batch
        for _ in range(steps):
            start = time.perf_counter()
            for i, matcher in enumerate(matchers):
                if tokens[i] is not None and not matcher.is_terminated():
                    matcher.accept_token(tokens[i])
            live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
            batch_matcher().batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, live)
            times.append(time.perf_counter() - start)
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [batch, >= VOCAB]
            for i in live:  # the next token: a random allowed one (as sampling would pick)
                tokens[i] = int(rng.choice(np.flatnonzero(bits[i, :VOCAB])))
        records.append({"measure": "fill", "case": f"batch {batch}", "ms": statistics.median(times) * 1e3,
                        "steps": steps})


def apply_cost(records: list[dict], device: torch.device) -> None:
    from baryon.kernels.selector import select

    kernel = select("token_bitmask", device)
    for batch in (1, 64):
        logits = torch.randn(batch, VOCAB, device=device)
        bitmask = torch.randint(-2**31, 2**31 - 1, (batch, -(-VOCAB // 32)), dtype=torch.int32, device=device)
        rows = torch.arange(batch, device=device)
        times = []
        for _ in range(20):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            kernel.apply(logits, bitmask, rows)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        records.append({"measure": "apply", "case": f"batch {batch} ({kernel.name}, {device.type})",
                        "ms": statistics.median(times[5:]) * 1e3})


def enum_array_spec():
    """A JSON array that cannot close within a benchmark's tokens (at least 400 items of 3-5
    tokens), so every constrained request decodes as many tokens as an unconstrained one."""
    from baryon import StructuredOutputsParams

    schema = {"type": "object", "properties": {"words": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                                         "minItems": 400}},
              "required": ["words"], "additionalProperties": False}
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def decode_cost(records: list[dict], model: str, batch_sizes: list[int], new_tokens: int, repeats: int,
                seed: int, engine_process: bool | None = None) -> None:
    from baryon import LLM, SamplingParams

    from baryon.bench.presets import PRESETS, resolve_model

    if model in PRESETS:
        config = PRESETS[model]
        tokenizer = byte_level_tokenizer(Path(tempfile.mkdtemp(prefix="byte-level-")),
                                         synthetic_vocab(config["vocab_size"], seed), config["eos_token_id"])
        llm = LLM(resolve_model(model), load_format="dummy", tokenizer=str(tokenizer), max_model_len=4096,
                  engine_process=engine_process)
    else:
        llm = LLM(model, engine_process=engine_process)
    spec = enum_array_spec()
    for batch in batch_sizes:
        def run(n: int, structured) -> float:
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=structured)
            start = time.perf_counter()
            outputs = llm.generate(["Once upon a time"] * batch, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == n for o in outputs), "a request ended early"
            return elapsed
        cases = (("unconstrained", None), ("json schema", spec))
        for _, structured in cases:
            run(2, structured)  # compile and warm up
        tpot = {label: [] for label, _ in cases}
        for _ in range(repeats):  # the two alternate, so a slow spell of the machine hits both
            for label, structured in cases:
                tpot[label].append((run(new_tokens, structured) - run(1, structured)) / (new_tokens - 1))
        for label, times in tpot.items():
            records.append({"measure": "decode", "case": f"batch {batch}, {label}",
                            "ms": statistics.median(times) * 1e3, "best_ms": min(times) * 1e3, "model": model})
        # Each repeat's constrained run over the unconstrained run just before it: a host whose
        # speed drifts between repeats (the H100 hosts' did by up to 40% within one call) moves
        # both runs of a pair alike, so the median of these ratios is steadier than the ratio of
        # the two medians.
        ratios = [c / u for u, c in zip(tpot["unconstrained"], tpot["json schema"])]
        records.append({"measure": "ratio", "case": f"batch {batch}, paired", "median": statistics.median(ratios),
                        "ratios": [round(r, 3) for r in ratios], "model": model})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(STORIES), help="checkpoint for the decode step (default: stories260K)")
    parser.add_argument("--batch", type=int, default=16, help="the larger decode batch (besides 1)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fill-steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="the decode engine's core in a process of its own (default: the engine's, on a GPU)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records: list[dict] = []
    host_costs(records, args.seed, args.fill_steps)
    apply_cost(records, device)
    decode_cost(records, args.model, [1, args.batch], args.new_tokens, args.repeats, args.seed, args.engine_process)
    for record in records:
        print(json.dumps(record))
    print(f"\n{'measure':<8} {'case':<40} {'ms':>9}")
    for record in records:
        if record["measure"] == "ratio":
            continue  # in the last lines
        print(f"{record['measure']:<8} {record['case']:<40} {record['ms']:>9.3f}")
    decode = {r["case"]: r["ms"] for r in records if r["measure"] == "decode"}
    paired = {r["case"]: r["median"] for r in records if r["measure"] == "ratio"}
    for batch in (1, args.batch):
        free, constrained = decode.get(f"batch {batch}, unconstrained"), decode.get(f"batch {batch}, json schema")
        if free and constrained:
            print(f"decode batch {batch}: constrained / unconstrained TPOT = {constrained / free:.3f} "
                  f"(median of paired runs: {paired[f'batch {batch}, paired']:.3f})")


if __name__ == "__main__":
    main()
