"""Sweep the latent-attention decode kernel's launch (keys per step, warps, pipeline stages, KV
splits) on this GPU at DeepSeek-V2-Lite's shape (16 heads, rank 512, rope 64, 16-token blocks).
Each case's blocks are scattered over the cache, as a served engine's are; times are CUDA-graph
replays (`triton.testing.do_bench_cudagraph`), microseconds.

    python benchmarks/tune_mla.py [--cases 256x640 64x1024 ...] [--heads 16]

Prints one JSON line per (case, launch) and a table of the best launches against the default last.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.kernels.attention.mla_triton import TritonMLAAttention

CASES = ["256x640", "64x1024", "64x8192", "1x1024", "1x32768"]
TILES = [32, 64]
WARPS = [4, 8]
STAGES = [1, 2, 3]
SPLITS = [None, 1, 2]  # None: the backend's own choice


def _case(num_seqs: int, seq_len: int, heads: int, rank: int, rope: int, device: torch.device):
    block = 16
    blocks_per_seq = -(-seq_len // block)
    total = num_seqs * blocks_per_seq
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(total, block, rank + rope, generator=gen).to(device, torch.bfloat16)
    tables = torch.randperm(total, generator=gen).to(torch.int32).view(num_seqs, blocks_per_seq).to(device)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    metadata = AttentionMetadata(num_seqs, starts.to(device), seq_lens.to(device), tables,
                                 torch.full((num_seqs,), -1, device=device, dtype=torch.int64), 1, seq_len,
                                 starts, seq_lens)
    q_latent = torch.randn(num_seqs, heads, rank, generator=gen).to(device, torch.bfloat16)
    q_pe = torch.randn(num_seqs, heads, rope, generator=gen).to(device, torch.bfloat16)
    return q_latent, q_pe, cache, metadata


def main() -> None:
    import triton.testing

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=CASES, help="SEQSxCONTEXT")
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    device = torch.device("cuda")
    rank, rope = 512, 64
    rows = []
    for case in args.cases:
        num_seqs, seq_len = map(int, case.split("x"))
        q_latent, q_pe, cache, metadata = _case(num_seqs, seq_len, args.heads, rank, rope, device)
        reference = TritonMLAAttention(args.heads, rank, rope, 0.1).forward(q_latent, q_pe, cache, metadata)
        cache_bytes = num_seqs * seq_len * (rank + rope) * 2
        results = {}
        for launch, splits in [(None, None)] + list(itertools.product(itertools.product(TILES, WARPS, STAGES), SPLITS)):
            backend = TritonMLAAttention(args.heads, rank, rope, 0.1)
            backend.decode_launch, backend.num_kv_splits = launch, splits
            try:
                out = backend.forward(q_latent, q_pe, cache, metadata)
                torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=2e-2)
                us = triton.testing.do_bench_cudagraph(
                    lambda: backend.forward(q_latent, q_pe, cache, metadata), rep=30, return_mode="median") * 1e3
            except Exception as error:  # a launch that does not fit (shared memory, registers)
                print(json.dumps({"case": case, "launch": launch, "splits": splits, "error": str(error)[:80]}))
                continue
            results[(launch, splits)] = us
            print(json.dumps({"case": case, "launch": launch, "splits": splits, "us": round(us, 2),
                              "cache_TB_per_s": round(cache_bytes / us / 1e6, 2)}), flush=True)
        best = min(results, key=results.get)
        rows.append((case, results[(None, None)], best, results[best], cache_bytes))
    print(f"{'case':>10} {'default us':>11} {'best us':>9} {'TB/s':>6}  best (TILE_N, warps, stages), splits")
    for case, default, best, us, nbytes in rows:
        print(f"{case:>10} {default:>11.1f} {us:>9.1f} {nbytes / us / 1e6:>6.2f}  {best}")


if __name__ == "__main__":
    main()
