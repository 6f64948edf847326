"""Where a decode step's time goes: cProfile of the host side and torch.profiler's kernel table.

    python benchmarks/profile_decode.py --model qwen3-0.6b --batch-size 1 [engine flags]
    python benchmarks/profile_decode.py --model qwen3-8b --input-len 16384 --max-model-len 16640  # long context
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random

import torch

from baryon.bench.common import add_engine_flags, build_llm, random_token_prompts


def device_timeline(prof: torch.profiler.profile, steps: int) -> str:
    """Kernels per step, the device's busy time per step (the union of kernel intervals) and the
    span from the first kernel to the last, per step: busy / span is how full the GPU was kept."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not intervals:
        return "device timeline: no kernels recorded"
    busy, start, end = 0.0, *intervals[0]
    for s, e in intervals[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = intervals[-1][1] - intervals[0][0]
    return (f"device timeline: {len(intervals) / steps:.0f} kernels per step, busy {busy / steps / 1e3:.3f} ms "
            f"of {span / steps / 1e3:.3f} ms per step ({100 * busy / span:.0f}% busy; prefill included)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128,
                        help="prompt tokens (the profiled run finds them in the prefix cache: decode steps over "
                             "a context of this length)")
    parser.add_argument("--rows", type=int, default=15, help="rows of each kernel table")
    add_engine_flags(parser)
    parser.set_defaults(engine_process=False)  # the profilers see this process only
    args = parser.parse_args()
    from baryon.sampling_params import SamplingParams

    llm, _ = build_llm(args)
    prompts = random_token_prompts(random.Random(0), [args.input_len] * args.batch_size,
                                   min(llm.config.model.vocab_size, 10000))
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
    # Tensor parallelism: the collectives' device time per step (NCCL kernels, any custom all-reduce).
    collective_us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                        for e in prof.key_averages() if "nccl" in e.key.lower() or "all_reduce" in e.key.lower())
    print(f"collectives: {collective_us / args.steps / 1e3:.3f} ms of device time per step "
          f"(tensor_parallel_size={args.tensor_parallel_size}, batch {args.batch_size})")
    print(device_timeline(prof, args.steps))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
