"""Sweep the paged Triton attention's decode launch (`DecodeTiles`: keys per step, warps, pipeline
stages, split count and the fewest keys a split takes) at long and short contexts, and print the
fastest settings per case next to the defaults'.

    python benchmarks/tune_decode_attention.py [--contexts 512 2048 16384 32768 131072] [--batches 1 8]

Each time is a CUDA-graph replay (`triton.testing.do_bench_cudagraph`) of one decode attention call
per cache copy, over enough copies of the KV cache to overflow the L2 cache (as between a real
step's layers), divided by the copies. Heads: Qwen3-8B (32 query, 8 KV; one rank at TP=2: 16, 4) and Qwen3-0.6B (16, 8),
head_dim 128, block size 16, bf16. One JSON line per case (with GB/s of K and V read), then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.attention.triton_paged import DecodeTiles, TritonPagedAttention

HEADS = {"qwen3-8b": (32, 8), "qwen3-0.6b": (16, 8), "qwen3-8b-tp2": (16, 4)}  # tp2: one rank's heads at TP=2
HEAD_DIM, BLOCK = 128, 16


def _case(num_seqs: int, context: int, kv_heads: int, copies: int):
    """`copies` caches [2, blocks, 16, kv_heads, 128] and the decode metadata of num_seqs sequences
    of `context` tokens each (the new token's K/V already written)."""
    blocks_per_seq = -(-context // BLOCK)
    caches = [torch.randn(2, num_seqs * blocks_per_seq, BLOCK, kv_heads, HEAD_DIM, device="cuda",
                          dtype=torch.bfloat16) for _ in range(copies)]
    tables = torch.arange(num_seqs * blocks_per_seq, device="cuda", dtype=torch.int32).view(num_seqs, -1)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    slots = torch.full((num_seqs,), -1, dtype=torch.int64)
    metadata = AttentionMetadata(num_seqs, starts.cuda(), seq_lens.cuda(), tables, slots.cuda(), 1, context,
                                 starts, seq_lens)
    return caches, metadata


def _time(attn: TritonPagedAttention, q: torch.Tensor, caches, metadata) -> float:
    import triton.testing

    out = torch.empty_like(q)

    def step():
        for cache in caches:
            attn.forward(q, None, None, cache, metadata, out)

    return triton.testing.do_bench_cudagraph(step, rep=40, return_mode="median") * 1e3 / len(caches)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 16384, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--models", nargs="+", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--quick", action="store_true", help="fewer kernel shapes in the first sweep")
    args = parser.parse_args()

    default = TritonPagedAttention.decode_tiles
    # Stage 1: the kernel's own shape (tile, warps, stages) at 16k keys, batch 1, 64 splits.
    shapes = list(itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)))
    if args.quick:
        shapes = list(itertools.product((64, 128), (4, 8), (2, 3)))
    rows = []
    best_shape, best_us = None, float("inf")
    heads, kv_heads = HEADS[args.models[0]]
    caches, md = _case(1, 16384, kv_heads, 4)
    q = torch.randn(1, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for tile_n, warps, stages in shapes:
        attn = TritonPagedAttention(heads, HEAD_DIM, kv_heads, HEAD_DIM ** -0.5, None)
        attn.decode_tiles = DecodeTiles(tile_n, tile_n, 64, 1, warps, stages)
        attn.num_kv_splits = 64
        try:
            us = _time(attn, q, caches, md)
        except Exception as error:  # a shape this Triton cannot compile (shared memory)
            print(json.dumps({"stage": "shape", "tile_n": tile_n, "warps": warps, "stages": stages,
                              "error": str(error)[:120]}), flush=True)
            continue
        print(json.dumps({"stage": "shape", "tile_n": tile_n, "warps": warps, "stages": stages,
                          "us": round(us, 2)}), flush=True)
        if us < best_us:
            best_shape, best_us = (tile_n, warps, stages), us
    del caches
    tile_n, warps, stages = best_shape

    # Stage 2: splits and the smallest chunk, per model, batch and context, against the defaults.
    for model, num_seqs, context in itertools.product(args.models, args.batches, args.contexts):
        heads, kv_heads = HEADS[model]
        kv_bytes = 2 * num_seqs * context * kv_heads * HEAD_DIM * 2
        caches, md = _case(num_seqs, context, kv_heads, max(1, min(16, int(200e6 // kv_bytes))))
        q = torch.randn(num_seqs, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        attn = TritonPagedAttention(heads, HEAD_DIM, kv_heads, HEAD_DIM ** -0.5, None)
        attn.decode_tiles = default
        default_us = _time(attn, q, caches, md)
        default_splits = attn._decode_splits(num_seqs, q.device)
        results = {}
        for splits, min_chunk in itertools.product((1, 2, 4, 8, 16, 32, 64, 128), sorted({tile_n, 256, 512})):
            if splits == 1 and min_chunk != tile_n:
                continue
            attn.decode_tiles = DecodeTiles(tile_n, max(min_chunk, tile_n), 128, 1, warps, stages)
            attn.num_kv_splits = splits
            results[(splits, min_chunk)] = _time(attn, q, caches, md)
        attn.num_kv_splits = None
        (splits, min_chunk), us = min(results.items(), key=lambda item: item[1])
        row = {"model": model, "batch": num_seqs, "context": context, "default_us": round(default_us, 2),
               "default_splits": default_splits, "best_us": round(us, 2), "splits": splits, "min_chunk": min_chunk,
               "tile_n": tile_n, "warps": warps, "stages": stages,
               "default_GB_per_s": round(kv_bytes / default_us / 1e3, 1), "best_GB_per_s": round(kv_bytes / us / 1e3, 1),
               "all": {f"{s}/{c}": round(t, 2) for (s, c), t in results.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del caches

    print(f"\nkernel shape: tile_n={tile_n} warps={warps} stages={stages} ({best_us:.2f} us at 16k, 64 splits); "
          f"defaults: {dataclasses.asdict(default)}")
    print(f"{'model':<11} {'batch':>5} {'context':>7} {'default us':>10} {'(splits)':>8} {'best us':>8} "
          f"{'splits':>6} {'min_chunk':>9} {'GB/s':>7}")
    for r in rows:
        print(f"{r['model']:<11} {r['batch']:>5} {r['context']:>7} {r['default_us']:>10} {r['default_splits']:>8} "
              f"{r['best_us']:>8} {r['splits']:>6} {r['min_chunk']:>9} {r['best_GB_per_s']:>7}")


if __name__ == "__main__":
    main()
