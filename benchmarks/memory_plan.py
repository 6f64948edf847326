"""A model's memory plan across ranks, on paper: each rank's weights as the engine shards them (the
model built on the meta device with its quantized layouts in place, so nothing is allocated), the
KV-cache bytes per token each rank holds, and how many cached tokens a GPU of a given size leaves.

    python benchmarks/memory_plan.py --model deepseek-v3 --tensor-parallel-size 8 --enable-expert-parallel
    python benchmarks/memory_plan.py --model deepseek-v3 --data-parallel-size 8 --enable-expert-parallel
    python benchmarks/memory_plan.py --model deepseek-v3 --tensor-parallel-size 2 --enable-expert-parallel \
        --hf-overrides '{"num_hidden_layers": 4}' --gpu-memory-gib 79.1

One CPU process per rank over gloo, as the engine would start them (with data_parallel_size > 1 and
expert parallelism on a MoE model: the DP-attention replicas); every engine flag applies. Prints a
JSON line per rank, then a table. Activations and CUDA graphs are an input here (`--reserve-gib`):
the engine measures them at start-up (runner/kv_cache_sizing.py) and sizes the cache from what is left.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
from collections import defaultdict

import torch
import torch.multiprocessing as mp

GiB = 1 << 30


def _rank_plan(rank: int, world: int, init_method: str, engine_kwargs: dict, queue) -> None:
    from baryon.config import EngineConfig
    from baryon.distributed.parallel_state import destroy_distributed, init_distributed
    from baryon.layers.attention import PagedKVLayer
    from baryon.loader.model_loader import build_model

    config = EngineConfig.create(**engine_kwargs)
    parallel = config.parallel
    init_distributed(world, rank, init_method, "gloo", parallel.enable_expert_parallel, config.model.dtype,
                     data_parallel=parallel.data_parallel_attention)
    try:
        model = build_model(config.model, torch.device("meta"))
        by_dtype = defaultdict(int)
        for tensor in [*model.parameters(), *model.buffers()]:
            by_dtype[str(tensor.dtype).removeprefix("torch.")] += tensor.numel() * tensor.element_size()
        itemsize = torch.empty((), dtype=config.cache.kv_cache_dtype).element_size()
        kv_per_token = sum(math.prod(layer.cache_shape(1, 1)) * itemsize
                           for layer in model.modules() if isinstance(layer, PagedKVLayer))
        queue.put({"rank": rank, "weights_bytes": sum(by_dtype.values()), "weights_by_dtype": dict(by_dtype),
                   "kv_bytes_per_token": kv_per_token, "layers": config.model.hf_config.num_hidden_layers})
    finally:
        destroy_distributed()


def main() -> None:
    from baryon.engine_flags import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-memory-gib", type=float, default=139.8, help="one GPU's memory (default: an H200)")
    parser.add_argument("--reserve-gib", type=float, default=8.0,
                        help="per rank: peak activations, CUDA graphs and memory outside torch")
    add_engine_args(parser, defaults={"load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16"})
    args = parser.parse_args()
    kwargs = engine_kwargs(args)
    from baryon.bench.presets import resolve_model

    kwargs.update(model=resolve_model(args.model), device="cpu")
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    world = tp * dp
    if dp > 1 and not args.enable_expert_parallel:
        sys.exit("data_parallel_size > 1 without expert parallelism runs independent replicas: plan one with "
                 "--data-parallel-size 1")
    if dp > 1:  # the replicas of DP attention are the ranks; inside each, TP must be 1 (the engine's rule)
        kwargs["tensor_parallel_size"] = 1

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_rank_plan, args=(rank, world, init_method, kwargs, queue))
                 for rank in range(world)]
    for process in processes:
        process.start()
    plans = sorted((queue.get(timeout=600) for _ in processes), key=lambda plan: plan["rank"])
    for process in processes:
        process.join()

    usable = args.gpu_memory_gib * args.gpu_memory_utilization * GiB
    for plan in plans:
        free = usable - plan["weights_bytes"] - args.reserve_gib * GiB
        plan["kv_tokens"] = max(0, int(free // plan["kv_bytes_per_token"]))
        print(json.dumps(plan), flush=True)
    total_weights = sum(p["weights_bytes"] for p in plans)
    # TP ranks hold every token's cache (their share of the heads; MLA: the whole latent), so the
    # engine holds the smallest rank's count; DP-attention replicas each hold their own requests'.
    tokens = sum(p["kv_tokens"] for p in plans) if dp > 1 else min(p["kv_tokens"] for p in plans)
    layout = f"DP attention x {dp} + EP" if dp > 1 else f"TP={tp}" + (" + EP" if args.enable_expert_parallel else "")
    print(f"\n{args.model} ({plans[0]['layers']} layers), {layout}, {args.gpu_memory_gib} GiB GPUs at "
          f"{args.gpu_memory_utilization}, {args.reserve_gib} GiB reserved per rank for activations and graphs")
    print(f"{'rank':>4} {'weights GiB':>12} {'of which':<40} {'KV B/token':>10} {'KV tokens':>10}")
    for p in plans:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(p["weights_by_dtype"].items()))
        print(f"{p['rank']:>4} {p['weights_bytes'] / GiB:>12.2f} {parts:<40} {p['kv_bytes_per_token']:>10,} "
              f"{p['kv_tokens']:>10,}")
    print(f"all ranks: weights {total_weights / GiB:.2f} GiB; KV cache {tokens:,} tokens "
          f"({'summed over the replicas' if dp > 1 else 'each rank holds every token'})")


if __name__ == "__main__":
    main()
