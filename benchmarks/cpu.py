"""CPU benchmark against llama.cpp and Hugging Face transformers, in one run, on the same model
file and threads.

    python benchmarks/cpu.py                      # the default model (SmolLM2-135M-Instruct GGUF)
    python benchmarks/cpu.py --threads 1 --repeats 5

Measures, for baryon (`LLM.generate`), llama.cpp (`llama-cpp-python`, when installed and the model
is a .gguf file: the same file, its own kernels, greedy by argmax of its logits) and transformers
(`model.generate`, its KV cache; dequantizes a .gguf to --dtype), with --threads threads each:

- decode tokens/s at batch 1: (N - 1) / (time for N new tokens - time for 1 new token), so the
  prompt's prefill is left out;
- time to first token: the prompt's prefill plus one token;
- decode tokens/s at batch --batch: batch * (N - 1) / (time for N new tokens - time for 1), and
  generation throughput: batch * N new tokens / wall time (prefill included); llama.cpp is
  measured at batch 1 only (the ratio that matters is our batch against its batch 1).

Prompts are random token ids of one length, fresh for every call (no prefix-cache hit; no EOS
stops anyone early: baryon ignores EOS, transformers gets min_new_tokens = N, llama.cpp is driven
token by token). Each measurement is repeated --repeats times, baryon and
transformers alternating, and the best time is kept (the machine may be shared). On a machine
whose cores are busy, run it with OMP_WAIT_POLICY=PASSIVE (as the baryon CLI sets): spinning
OpenMP threads collapse under contention for both engines alike. Prints one JSON line;
`run(argv)` returns the same dict.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or checkpoint folder (default: the built-in model)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for both engines")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines' dtype")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per sequence")
    parser.add_argument("--batch", type=int, default=16, help="sequences in the throughput run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement (the best is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-transformers", action="store_true", help="leave transformers out")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "float16"], help="baryon's KV cache")
    return parser.parse_args(argv)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Baryon:
    name = "baryon"
    batched = True

    kv_cache_dtype = "auto"  # --kv-cache-dtype

    def __init__(self, model_path: str, dtype: str, max_len: int, batch: int, threads: int) -> None:
        from baryon import LLM

        self.llm = LLM(model_path, device="cpu", dtype=dtype, max_model_len=max_len, max_num_seqs=batch,
                       skip_tokenizer_init=True, kv_cache_dtype=self.kv_cache_dtype)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        from baryon import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)


class LlamaCpp:
    name = "llama.cpp"
    batched = False

    def __init__(self, model_path: str, dtype: str, max_len: int, batch: int, threads: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path, n_ctx=max_len, n_batch=max_len, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.vocab = self.llm.n_vocab()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        import numpy as np

        (prompt,) = prompts
        self.llm.reset()
        self.llm.eval(prompt)
        for _ in range(new_tokens):
            logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,))
            token = int(logits.argmax())
            self.llm.eval([token])


class Transformers:
    name = "transformers"
    batched = True

    def __init__(self, model_path: str, dtype: str, max_len: int, batch: int, threads: int) -> None:
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, dtype)
        if model_path.endswith(".gguf"):
            folder, name = os.path.split(model_path)
            self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model.eval()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts)  # [batch, prompt_len]: one length, no padding
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + new_tokens


def measure(engines: list, args: argparse.Namespace, vocab: int) -> dict[str, dict[str, Any]]:
    rng = random.Random(args.seed)

    def prompts(count: int) -> list[list[int]]:  # fresh ones for every call: no prefix-cache hits
        return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(count)]

    for engine in engines:  # warm-up: first-call allocations and lazy initialisation
        engine.generate(prompts(1), 2)
    times: dict[str, dict[str, list[float]]] = {e.name: {"first": [], "bs1": [], "batch_first": [], "batch": []}
                                                for e in engines}
    for _ in range(args.repeats):
        for engine in engines:
            one, other = prompts(1), prompts(1)
            times[engine.name]["first"].append(timed(lambda: engine.generate(one, 1)))
            times[engine.name]["bs1"].append(timed(lambda: engine.generate(other, args.new_tokens)))
            if engine.batched:
                batch, other_batch = prompts(args.batch), prompts(args.batch)
                times[engine.name]["batch_first"].append(timed(lambda: engine.generate(batch, 1)))
                times[engine.name]["batch"].append(timed(lambda: engine.generate(other_batch, args.new_tokens)))
    results = {}
    for name, t in times.items():
        decode = [(args.new_tokens - 1) / (full - first) for full, first in zip(t["bs1"], t["first"])]
        results[name] = {
            "decode_bs1_tok_s": round(max(decode), 2), "decode_bs1_tok_s_median": round(statistics.median(decode), 2),
            "time_to_first_token_s": round(min(t["first"]), 4),
        }
        if t["batch"]:
            throughput = [args.batch * args.new_tokens / s for s in t["batch"]]
            results[name][f"throughput_bs{args.batch}_tok_s"] = round(max(throughput), 2)
            results[name][f"throughput_bs{args.batch}_tok_s_median"] = round(statistics.median(throughput), 2)
            decode = [args.batch * (args.new_tokens - 1) / (full - first) for full, first in zip(t["batch"], t["batch_first"])]
            results[name][f"decode_bs{args.batch}_tok_s"] = round(max(decode), 2)
            results[name][f"decode_bs{args.batch}_tok_s_median"] = round(statistics.median(decode), 2)
    return results


def llama_cpp_available(model_path: str) -> bool:
    return model_path.endswith(".gguf") and importlib.util.find_spec("llama_cpp") is not None


def run(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from baryon.default_model import default_model_path

    model_path = args.model or default_model_path()
    Baryon.kv_cache_dtype = args.kv_cache_dtype
    max_len = args.prompt_len + args.new_tokens + 8
    engines, load_s = [], {}
    others = ([] if args.no_llama_cpp or not llama_cpp_available(model_path) else [LlamaCpp])
    others += [] if args.no_transformers else [Transformers]
    for cls in [Baryon] + others:
        start = time.perf_counter()
        engines.append(cls(model_path, args.dtype, max_len, args.batch, args.threads))
        load_s[cls.name] = round(time.perf_counter() - start, 2)
        if cls is Baryon:  # peak resident memory after baryon's load (before transformers exists)
            baryon_peak_rss_gib = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    vocab = engines[0].llm.config.model.vocab_size
    results = measure(engines, args, vocab)
    report: dict[str, Any] = {
        "benchmark": "cpu", "model": os.path.basename(model_path), "dtype": args.dtype, "threads": args.threads,
        "kv_cache_dtype": args.kv_cache_dtype,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset: spinning)"),
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch": args.batch, "repeats": args.repeats,
        "load_s": load_s, "baryon_peak_rss_gib_after_load": baryon_peak_rss_gib, **results,
    }
    ours = results["baryon"]
    if "llama.cpp" in results:  # our figures over llama.cpp's batch-1 ones (TTFT: theirs over ours)
        theirs = results["llama.cpp"]
        report["vs_llama_cpp"] = {
            "decode_bs1": round(ours["decode_bs1_tok_s"] / theirs["decode_bs1_tok_s"], 2),
            f"decode_bs{args.batch}_over_their_bs1": round(ours[f"decode_bs{args.batch}_tok_s"] / theirs["decode_bs1_tok_s"], 2),
            "time_to_first_token_speedup": round(theirs["time_to_first_token_s"] / ours["time_to_first_token_s"], 2)}
    if "transformers" in results:
        theirs = results["transformers"]
        report["vs_transformers"] = {key: round(ours[key] / theirs[key], 2) for key in ours
                                     if key.endswith("tok_s") and theirs.get(key)}
    return report


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(argv)))


if __name__ == "__main__":
    main()
