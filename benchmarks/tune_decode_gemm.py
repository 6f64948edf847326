"""The 16-bit decode GEMM (`dense_decode_linear`, swap AB) against cuBLAS (F.linear) on the Qwen3
presets' projections (CUDA): per shape and row count cuBLAS, the table's choice and the fastest
candidate tiles and K split; then a decode step's projections (layers x qkv, o, gate/up, down,
each reading a prefix of the previous one's output, every layer its own weights) chained in one
CUDA graph three ways: all cuBLAS, as the layers choose (the table), and each shape by the sweep's
winner (where the sweep ran).

    python benchmarks/tune_decode_gemm.py [--models qwen3-8b-tp2 qwen3-8b] [--m 8 16 64] [--chain-m 16 64] [--quick]

Each time is a CUDA-graph replay (`triton.testing.do_bench_cudagraph`) over copies of the weight
that overflow the L2 cache, divided by the copies. One JSON line per case, then a table.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from tune_dense_gemv import MODELS, _bench


def candidate_tiles(m: int, quick: bool):
    """Tiles to try for m rows: the batch's token tile (and half of it past 32 rows), 64 or 128
    weight rows, 64 to 256 columns a step, 3 to 6 stages; those whose stages overflow shared memory
    left out."""
    from baryon.kernels.swap_ab_gemm import DecodeTiles

    whole = max(16, 1 << (m - 1).bit_length())
    token_tiles = [whole] + ([whole // 2] if whole > 32 else [])
    widths = (128, 256) if quick else (64, 128, 256)
    stages = (3, 4) if quick else (3, 4, 6)
    for bm, bn, bk, warps, st in itertools.product(token_tiles, (64, 128), widths, (4, 8), stages):
        if st * (bn + bm) * bk * 2 <= 200 * 1024 and (warps == 4 or bn == 128):
            yield DecodeTiles(bm, bn, bk, warps, st)


def sweep(model: str, ms: list[int], quick: bool) -> tuple[list[dict], dict]:
    """Rows per (shape, m), and the winner per (n, k, m): ("cublas", None, None) or ("triton", tiles, split)."""
    from baryon.kernels.dense_decode_gemm import TritonDenseDecodeLinear, plan

    rows, winners = [], {}
    for (n, k), m in itertools.product(MODELS[model][0], ms):
        copies = max(1, int(256e6 // (2 * n * k)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cublas = _bench(lambda: [F.linear(x, w) for w in weights], copies)
        table, table_split = plan(m, n, k)
        table_us = _bench(lambda: [TritonDenseDecodeLinear.forward(x, w) for w in weights], copies) \
            if table is not None else None  # None: the table leaves the shape to cuBLAS
        best = None
        for tiles in candidate_tiles(m, quick):
            for split in (1, 2, 4):
                try:
                    us = _bench(lambda: [TritonDenseDecodeLinear.forward(x, w, split=split, tiles=tiles)
                                         for w in weights], copies)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                    print(json.dumps({"skipped": list(tiles), "error": str(e)[:120]}), flush=True)
                    break
                if best is None or us < best[0]:
                    best = (us, tiles, split)
        row = {"model": model, "N": n, "K": k, "M": m, "cublas_us": round(cublas, 2),
               "table": list(table) if table else None, "table_split": table_split,
               "table_us": round(table_us, 2) if table_us else None,
               "best_us": round(best[0], 2), "best_tiles": list(best[1]), "best_split": best[2],
               "best_TB_per_s": round(2 * n * k / best[0] / 1e6, 2),
               "cublas_TB_per_s": round(2 * n * k / cublas / 1e6, 2)}
        winners[(n, k, m)] = ("triton", best[1], best[2]) if best[0] < cublas else ("cublas", None, None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows, winners


def chain(model: str, m: int, winners: dict) -> dict:
    """A decode step's projections over every layer in one graph: ms per step three ways."""
    from baryon.kernels.dense_decode_gemm import TritonDenseDecodeLinear

    shapes, layers = MODELS[model]
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in shapes]
               for _ in range(layers)]
    x0 = torch.randn(m, shapes[0][1], device="cuda", dtype=torch.bfloat16)

    def step(pick):
        x = x0
        for layer in weights:
            for w in layer:
                x = pick(x[:, :w.shape[1]], w)  # [m, N]; a prefix of it feeds the next
        return x

    def table(x, w):
        n, k = w.shape
        return TritonDenseDecodeLinear.forward(x, w) if TritonDenseDecodeLinear.serves(m, n, k) else F.linear(x, w)

    def best(x, w):
        kind, tiles, split = winners[(*w.shape, m)]
        return TritonDenseDecodeLinear.forward(x, w, split=split, tiles=tiles) if kind == "triton" else F.linear(x, w)

    nbytes = 2 * layers * sum(n * k for n, k in shapes)
    row = {"model": model, "M": m, "chain": f"{layers} x {len(shapes)}"}
    for name, pick in (("cublas", F.linear), ("table", table), ("best", best)):
        if name == "best" and any((n, k, m) not in winners for n, k in shapes):
            continue
        ms = _bench(lambda: step(pick)) / 1e3
        row[f"{name}_ms"], row[f"{name}_TB_per_s"] = round(ms, 4), round(nbytes / ms / 1e9, 2)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen3-8b-tp2", "qwen3-8b"], choices=sorted(MODELS))
    parser.add_argument("--m", type=int, nargs="*", default=[8, 16, 64], help="row counts to sweep")
    parser.add_argument("--chain-m", type=int, nargs="*", default=[16, 64], help="row counts of the chained step")
    parser.add_argument("--quick", action="store_true", help="fewer candidate tiles")
    args = parser.parse_args()
    rows, chains = [], []
    for model in args.models:
        model_rows, winners = sweep(model, args.m, args.quick)
        rows += model_rows
        chains += [chain(model, m, winners) for m in args.chain_m]
    print(f"\n{'model':14} {'N x K':12} {'M':>3} {'cublas':>8} {'table':>8} {'best':>8}  "
          "best tiles (BM, BN, BK, warps, stages) split")
    for r in rows:
        print(f"{r['model']:14} {str(r['N']) + 'x' + str(r['K']):12} {r['M']:>3} {r['cublas_us']:>8} "
              f"{r['table_us'] or '-':>8} {r['best_us']:>8}  {r['best_tiles']} {r['best_split']}")
    print(f"\n{'model':14} {'M':>3} {'cublas ms':>10} {'table ms':>10} {'best ms':>10}   "
          "(chained projections of one step)")
    for c in chains:
        print(f"{c['model']:14} {c['M']:>3} {c['cublas_ms']:>10} {c['table_ms']:>10} {c.get('best_ms', '-'):>10}")


if __name__ == "__main__":
    main()
