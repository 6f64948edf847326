"""W4A16 past decode sizes (CUDA), on Qwen3-8B's projections (4-bit, groups of 128) at 64 to 4096
tokens: the tensor-core kernel of the triton-mma layout (`w4_mma`, up to its MAX_M rows) and the
tiled GEMM of the interleaved layout (which 8-bit codes and other group sizes take), both
dequantizing in registers, against dequantizing the weight once (`TritonW4A16Linear.dequantize_to`,
one kernel) followed by cuBLAS. `w4_mma.MAX_M` and `DEQUANTIZE_MIN_M` in `kernels/quant/w4a16.py`
are where the last starts winning.

    python benchmarks/w4a16_paths.py [--m 64 128 256 4096]

Times are CUDA-graph replays (`triton.testing.do_bench_cudagraph`), microseconds per call; one JSON
line per shape and token count.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qkv, o, gate/up, down (N, K)


def main() -> None:
    import triton.testing

    from baryon.kernels.quant import w4_mma
    from baryon.kernels.quant.w4a16 import TritonW4A16Linear, tile_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[64, 128, 129, 256, 512, 1024, 4096])
    args = parser.parse_args()

    def bench(fn) -> float:
        return round(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3, 1)

    for n, k in SHAPES:
        codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
        scales = torch.rand(n, k // 128, device="cuda", dtype=torch.bfloat16) * 0.02
        zeros = torch.full((n, k // 128), 8, device="cuda", dtype=torch.uint8)
        interleaved = TritonW4A16Linear.prepare(codes, scales, zeros, 4, 128, layout="triton")
        mma = TritonW4A16Linear.prepare(codes, scales, zeros, 4, 128)
        print(json.dumps({"N": n, "K": k, "dequantize_us": bench(lambda: TritonW4A16Linear.dequantize_to(
            mma, torch.bfloat16))}), flush=True)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tiles = tile_config(m, n, k, x.device)
            row = {"N": n, "K": k, "M": m,
                   "gemm_us": bench(lambda: TritonW4A16Linear.forward(x, interleaved, tiles=tiles)),
                   "dequantize_cublas_us": bench(lambda: F.linear(x, TritonW4A16Linear.dequantize_to(mma, x.dtype)))}
            if m <= w4_mma.MAX_M:
                row["mma_us"] = bench(lambda: TritonW4A16Linear.forward(x, mma, tiles=w4_mma.tiles_for(m, n, k, x.device)))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
