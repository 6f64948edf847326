"""Image prompts on an image-and-text preset (dummy weights): the vision tower alone per image size,
and whole requests with one image each against the same requests with text of the same length.

    python benchmarks/vision_language.py [--model qwen3-vl-8b] [--num-requests 64] [--sizes 448 896 1344]
    python benchmarks/vision_language.py --device cpu --num-requests 2 --sizes 64 96 \
        --hf-overrides '{"num_hidden_layers": 1}'   # a smoke run on a CPU

Prints one JSON line per measurement, then a short table:
- `tower`: the vision tower's time for one image of S x S pixels (its patches and tokens), and the
  host's image processor's for it (`processor_ms`: part of every image request's time);
- `requests`: N requests of one S x S image + 32 text tokens, 128 new tokens each (greedy, ignore
  EOS): wall time, prompt and output tokens per second; `text` is the same with text tokens in
  place of the image's (the language model's own cost), so the difference is the images';
- `latency-bs1`: one image request alone: time to first token and time per output token.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from PIL import Image

from baryon import LLM, SamplingParams
from baryon.bench.presets import resolve_model


def _image(rng: np.random.Generator, size: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tower(llm: LLM, rng: np.random.Generator, size: int, repeats: int = 5) -> dict:
    engine = llm.engine
    picture, token = _image(rng, size), engine.config.model.hf_config.image_token_id
    engine.process_images([token], {"image": picture})
    start = time.perf_counter()
    for _ in range(repeats):  # the host's part: the checkpoint's image processor (PIL or torchvision)
        _, inputs = engine.process_images([token], {"image": picture})
    processor_ms = (time.perf_counter() - start) / repeats * 1e3
    image = inputs.images[0]
    runner = engine.core.runner
    patches = torch.from_numpy(image.patch_array().copy()).to(runner.device)
    with torch.inference_mode():
        for _ in range(2):  # warm-up
            runner.model.encode_images(patches, [image.grid])
        _sync()
        start = time.perf_counter()
        for _ in range(repeats):
            runner.model.encode_images(patches, [image.grid])
        _sync()
    ms = (time.perf_counter() - start) / repeats * 1e3
    return {"bench": "tower", "size": size, "patches": patches.shape[0], "tokens": image.num_tokens,
            "ms": round(ms, 3), "tokens_per_s": round(image.num_tokens / ms * 1e3),
            "processor_ms": round(processor_ms, 2)}


def requests(llm: LLM, rng: np.random.Generator, size: int, num: int, with_images: bool) -> dict:
    config = llm.engine.config.model.hf_config
    image_token, num_image_tokens = config.image_token_id, None
    prompts = []
    for _ in range(num):
        text = [int(t) for t in rng.integers(1000, 100000, 32)]
        image = _image(rng, size)
        if num_image_tokens is None:
            num_image_tokens = llm.engine.process_images([image_token], {"image": image})[1].images[0].num_tokens
        if with_images:
            ids = [config.vision_start_token_id, image_token, config.vision_end_token_id] + text
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": image}})
        else:
            filler = [int(t) for t in rng.integers(1000, 100000, num_image_tokens + 2)]
            prompts.append({"prompt_token_ids": filler + text})
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"bench": "requests" if with_images else "text", "size": size, "num_requests": num,
            "prompt_tokens_each": prompt_tokens // num, "seconds": round(elapsed, 3),
            "prompt_tok_per_s": round(prompt_tokens / elapsed), "output_tok_per_s": round(output_tokens / elapsed)}


def latency(llm: LLM, rng: np.random.Generator, size: int) -> dict:
    """A fresh image prompt's time to first token; then, its prefix cached, 129 tokens against 1
    (the difference over 128: the time per output token)."""
    config = llm.engine.config.model.hf_config
    ids = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id] + \
        [int(t) for t in rng.integers(1000, 100000, 32)]
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": _image(rng, size)}}

    def seconds(max_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    ttft = seconds(1)
    one, many = seconds(1), seconds(129)
    return {"bench": "latency-bs1", "size": size, "ttft_ms": round(ttft * 1e3, 2),
            "tpot_ms": round((many - one) / 128 * 1e3, 3)}


def profile_tower(llm: LLM, rng: np.random.Generator, size: int, top: int = 12) -> None:
    """The tower's CUDA kernels for one S x S image, by total time (printed)."""
    engine = llm.engine
    _, inputs = engine.process_images([engine.config.model.hf_config.image_token_id], {"image": _image(rng, size)})
    image, runner = inputs.images[0], engine.core.runner
    patches = torch.from_numpy(image.patch_array().copy()).to(runner.device)
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.model.encode_images(patches, [image.grid])
        _sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-vl-8b")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--sizes", type=int, nargs="+", default=[448, 896, 1344])
    parser.add_argument("--device", default=None)
    parser.add_argument("--profile", action="store_true", help="also print the tower's top CUDA kernels")
    parser.add_argument("--host-profile", action="store_true",
                        help="also print where the host's time goes in the first size's image requests (cProfile)")
    parser.add_argument("--hf-overrides", default=None, help='e.g. \'{"num_hidden_layers": 1}\' (a smoke run)')
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    kwargs = {"device": args.device} if args.device else {}
    if args.hf_overrides:
        kwargs["hf_overrides"] = args.hf_overrides
    # (the engine core in this process: the tower is timed through its runner)
    llm = LLM(resolve_model(args.model), load_format="dummy", max_model_len=8192, engine_process=False, **kwargs)
    rows = []
    if args.profile:
        profile_tower(llm, rng, args.sizes[1] if len(args.sizes) > 1 else args.sizes[0])
    for size in args.sizes:
        rows.append(tower(llm, rng, size))
        print(json.dumps(rows[-1]), flush=True)
    if args.host_profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(requests, llm, rng, args.sizes[0], args.num_requests, True)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    for size in args.sizes[:2]:
        for with_images in (True, False):
            rows.append(requests(llm, rng, size, args.num_requests, with_images))
            print(json.dumps(rows[-1]), flush=True)
    rows.append(latency(llm, rng, args.sizes[0]))
    print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'bench':<12} {'size':>5}  result")
    for row in rows:
        rest = {k: v for k, v in row.items() if k not in ("bench", "size")}
        print(f"{row['bench']:<12} {row['size']:>5}  {rest}")


if __name__ == "__main__":
    main()
