"""Sweep the tiles of the decode GEMVs (8-bit weights: `w8_gemv`; W4A16: `w4-mma`, the tensor-core
kernel of 4-bit weights in aligned groups, and `w4a16`, the GEMV of the interleaved layout that
8-bit codes and other group sizes take) on Qwen3-8B's projections and print, per (kernel, shape,
M), the fastest tiles and the table's.

    python benchmarks/tune_quant_gemv.py [--m 1 4] [--quick] [--kernels fp8 fp8-block w4-mma w4a16]

Each time is a CUDA-graph replay (`triton.testing.do_bench_cudagraph`) of calls over enough copies
of the weight to overflow the L2 cache, divided by the copies: a weight read from memory, no launch
overhead, as in a decode step. One JSON line per case, then a table.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qkv, o, gate/up, down (N, K)


def _bench(fn, copies: int) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3 / copies


def _w8_cases(n, k, block, m, quick):
    from baryon.kernels.quant.act_quant import FP8
    from baryon.kernels.quant.w8_gemv import TritonW8Gemv, tile_config

    copies = max(1, int(256e6 // (n * k)))
    weights = [(torch.randn(n, k, device="cuda") * 40).clamp(-448, 448).to(FP8) for _ in range(copies)]
    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(shape, device="cuda") * 1e-3
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    grid = itertools.product((4, 8) if quick else (4, 8, 16, 32), (256, 512) if quick else (256, 512, 1024),
                             (4,) if quick else (4, 8))
    tried = {}
    for tiles in [None, *grid]:
        key = tile_config(m, n, tiles)
        if key in tried:
            continue
        tried[key] = _bench(lambda: [TritonW8Gemv.forward(x, w, scale, block, tiles=key) for w in weights], copies)
    return tried, tile_config(m, n), n * k


def _w4_cases(n, k, bits, m, quick):
    from baryon.kernels.quant.w4a16 import GemvTiles, TritonW4A16Linear, gemv_tiles

    copies = max(1, int(256e6 // (n * k * bits / 8)))
    codes = torch.randint(0, 1 << bits, (n, k), device="cuda", dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(n, k // 128, device="cuda", dtype=torch.bfloat16) * 1e-2
    zeros = torch.full((n, k // 128), 1 << (bits - 1), device="cuda", dtype=torch.uint8)
    weights = [TritonW4A16Linear.prepare(codes, scales, zeros, bits, 128, layout="triton") for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    # (row groups of 8 rows, 128-code blocks per step, warps, prefetch)
    grid = itertools.product((1, 2) if quick else (1, 2, 4), (4, 16, 32) if quick else (2, 4, 8, 16, 32),
                             (4, 8), (True, False))
    tried = {}
    table = gemv_tiles(n, k, bits)
    for tiles in [table, *(GemvTiles(*t) for t in grid)]:
        if tiles in tried:
            continue
        tried[tiles] = _bench(lambda: [TritonW4A16Linear.forward(x, w, tiles=tiles) for w in weights], copies)
    return tried, table, n * k * bits / 8


def _w4_mma_cases(n, k, m, quick):
    from baryon.kernels.quant import w4_mma
    from baryon.kernels.quant.w4a16 import TritonW4A16Linear

    copies = max(1, int(256e6 // (n * k / 2)))
    codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(n, k // 128, device="cuda", dtype=torch.bfloat16) * 1e-2
    zeros = torch.full((n, k // 128), 8, device="cuda", dtype=torch.uint8)
    weights = [TritonW4A16Linear.prepare(codes, scales, zeros, 4, 128) for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    table = w4_mma.tiles_for(m, n, k, x.device)
    splits = sorted({1, max(1, table.split_k // 2), table.split_k, table.split_k * 2})
    # (block_n, num_warps, num_stages, split_k): 64-row tiles and more take a warpgroup MMA per 64 rows
    grid = itertools.product((32, 64, 128), (4, 8), (3, 5) if quick else (3, 4, 6, 8), splits)
    tried = {}
    for block_n, warps, stages, split in [(table.block_n, table.num_warps, table.num_stages, table.split_k), *grid]:
        tiles = w4_mma.MmaTiles(table.block_m, block_n, split, warps, stages)
        if tiles in tried or (warps == 8 and block_n != 128):  # eight warps only on 128-row tiles
            continue
        tried[tiles] = _bench(lambda: [TritonW4A16Linear.forward(x, w, tiles=tiles) for w in weights], copies)
    return tried, table, n * k / 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--quick", action="store_true", help="a small grid")
    parser.add_argument("--kernels", nargs="+", default=["fp8", "fp8-block", "w4-mma", "w4a16"],
                        choices=["fp8", "fp8-block", "w4-mma", "w4a16"])
    args = parser.parse_args()
    rows = []
    for kernel, (n, k), m in itertools.product(args.kernels, SHAPES, args.m):
        if kernel == "w4a16":
            tried, table, nbytes = _w4_cases(n, k, 4, m, args.quick)
        elif kernel == "w4-mma":
            tried, table, nbytes = _w4_mma_cases(n, k, m, args.quick)
        else:
            tried, table, nbytes = _w8_cases(n, k, (128, 128) if kernel == "fp8-block" else None, m, args.quick)
        best = min(tried, key=tried.get)
        row = {"kernel": kernel, "N": n, "K": k, "M": m, "best": str(best), "best_us": round(tried[best], 2),
               "best_GB_per_s": round(nbytes / tried[best] / 1e3), "table": str(table),
               "table_us": round(tried[table], 2), "table_GB_per_s": round(nbytes / tried[table] / 1e3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'kernel':10} {'N x K':12} {'M':>3} {'table us':>9} {'GB/s':>6} {'best us':>8} {'GB/s':>6}  best tiles")
    for r in rows:
        print(f"{r['kernel']:10} {r['N']}x{r['K']:<7} {r['M']:>3} {r['table_us']:>9} {r['table_GB_per_s']:>6} "
              f"{r['best_us']:>8} {r['best_GB_per_s']:>6}  {r['best']}")


if __name__ == "__main__":
    main()
