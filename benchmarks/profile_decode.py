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


_LONG_GAP_US = 1000.0  # a gap this long is the host's one-off work, not a step's


def device_timeline(prof: torch.profiler.profile, steps: int, top_gaps: int = 8) -> str:
    """Kernels per step, the device's busy time per step (the union of kernel intervals) and the
    span from the first kernel to the last, per step: busy / span is how full the GPU was kept.
    Then where the idle time falls: the gaps summed by the (last kernel before, first kernel after)
    pair, largest first, in us per step (copies and memsets count as kernels); gaps of a
    millisecond or more (the host's one-off work: the first step, the end of the run) apart."""
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not events:
        return "device timeline: no kernels recorded"
    busy, (start, end, last_name) = 0.0, events[0]
    gaps: dict[tuple[str, str], list[float]] = {}
    for s, e, name in events[1:]:
        if s > end:
            busy += end - start
            gaps.setdefault((last_name, name), []).append(s - end)
            start, end = s, e
        elif e < end:
            continue  # inside the interval: the kernel that ends it stays its last
        else:
            end = e
        last_name = name
    busy += end - start
    span = events[-1][1] - events[0][0]
    long_gaps = [g for lengths in gaps.values() for g in lengths if g >= _LONG_GAP_US]
    gaps = {pair: short for pair, lengths in gaps.items() if (short := [g for g in lengths if g < _LONG_GAP_US])}
    lines = [f"device timeline: {len(events) / steps:.0f} kernels per step, busy {busy / steps / 1e3:.3f} ms "
             f"of {span / steps / 1e3:.3f} ms per step ({100 * busy / span:.0f}% busy; prefill included)",
             f"idle: {len(long_gaps)} gaps of >= 1 ms ({sum(long_gaps) / 1e3:.2f} ms in all), and "
             f"{sum(map(sum, gaps.values())) / steps:.1f} us per step in shorter ones; "
             f"those by (kernel before -> kernel after), us per step (top {top_gaps}):"]
    for (before, after), lengths in sorted(gaps.items(), key=lambda item: -sum(item[1]))[:top_gaps]:
        lines.append(f"  {sum(lengths) / steps:8.1f} us  ({len(lengths) / steps:.1f} gaps, longest "
                     f"{max(lengths):.1f} us)  {before[:60]} -> {after[:60]}")
    return "\n".join(lines)


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
