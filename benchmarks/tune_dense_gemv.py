"""The 16-bit decode GEMV (`dense_gemv`) against cuBLAS (F.linear) on the Qwen3 presets' projections
(CUDA; and Gemma-2-9B's): per shape and row count the fastest tiles and the table's; then a decode step's
projections (layers x qkv, o, gate/up, down, each reading the previous one's output) chained in
one CUDA graph, cuBLAS against the GEMV, which is where programmatic dependent launch shows.

    python benchmarks/tune_dense_gemv.py [--models qwen3-8b qwen3-0.6b qwen3-8b-tp2] [--m 1 2 4 8] [--quick]

Each time is a CUDA-graph replay (`triton.testing.do_bench_cudagraph`) over copies of the weight
that overflow the L2 cache, divided by the copies. One JSON line per case, then a table.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

# (N, K) of qkv, o, gate/up, down, and the layer count
MODELS = {
    "qwen3-8b": ([(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)], 36),
    "qwen3-0.6b": ([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], 28),
    "gemma-2-9b": ([(8192, 3584), (3584, 4096), (28672, 3584), (3584, 14336)], 42),
    # one rank's share at tensor parallelism 2: column-parallel N and row-parallel K halved
    "qwen3-8b-tp2": ([(3072, 4096), (4096, 2048), (12288, 4096), (4096, 6144)], 36),
}


def _bench(fn, copies: int = 1) -> float:
    """Microseconds per call."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3 / copies


def shape_rows(model: str, ms: list[int], quick: bool) -> list[dict]:
    from baryon.kernels.dense_gemv import TritonDenseGemv, tile_config

    rows = []
    for (n, k), m in itertools.product(MODELS[model][0], ms):
        copies = max(1, int(256e6 // (2 * n * k)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cublas = _bench(lambda: [F.linear(x, w) for w in weights], copies)
        if m > 1:  # x's rows multiply each weight tile in registers: shorter steps along K
            grid = itertools.product((4, 8, 16), (64, 128, 256), (4, 8))
        else:
            grid = itertools.product((4, 8, 16) if quick else (2, 4, 8, 16, 32),
                                     (256, 512) if quick else (128, 256, 512, 1024), (4, 8))
        tried = {}
        for tiles in [None, *grid]:
            key = tile_config(m, n, k, tiles)
            if key not in tried:
                tried[key] = _bench(lambda: [TritonDenseGemv.forward(x, w, tiles=key) for w in weights], copies)
        best = min(tried, key=tried.get)
        table = tile_config(m, n, k)
        row = {"model": model, "N": n, "K": k, "M": m, "cublas_us": round(cublas, 2), "table": str(table),
               "table_us": round(tried[table], 2), "best": str(best), "best_us": round(tried[best], 2),
               "best_GB_per_s": round(2 * n * k / tried[best] / 1e3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del weights
    return rows


def chain_row(model: str, m: int) -> dict:
    """A decode step's projections in one graph: cuBLAS against the GEMV (table tiles)."""
    from baryon.kernels.dense_gemv import TritonDenseGemv

    shapes, layers = MODELS[model]
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in shapes] for _ in range(layers)]
    x0 = torch.randn(m, shapes[0][1], device="cuda", dtype=torch.bfloat16)

    def step(linear):
        def run():
            x = x0
            for layer in weights:
                for w in layer:
                    x = linear(x[:, :w.shape[1]], w)  # the next projection reads this one's output
        return run

    cublas = _bench(step(F.linear))
    gemv = _bench(step(TritonDenseGemv.forward))
    nbytes = sum(2 * n * k for n, k in shapes) * layers
    row = {"model": model, "chain": f"{layers} x {len(shapes)}", "M": m, "cublas_ms": round(cublas / 1e3, 3),
           "gemv_ms": round(gemv / 1e3, 3), "cublas_TB_per_s": round(nbytes / cublas / 1e6, 2),
           "gemv_TB_per_s": round(nbytes / gemv / 1e6, 2)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen3-8b", "qwen3-0.6b"], choices=list(MODELS))
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--quick", action="store_true", help="a small grid")
    parser.add_argument("--no-shapes", action="store_true", help="only the chained step")
    args = parser.parse_args()
    rows = [] if args.no_shapes else [r for model in args.models for r in shape_rows(model, args.m, args.quick)]
    chains = [chain_row(model, m) for model in args.models for m in args.m]
    print(f"\n{'model':11} {'N x K':12} {'M':>2} {'cuBLAS us':>9} {'table us':>9} {'best us':>8} {'GB/s':>6}  best tiles")
    for r in rows:
        print(f"{r['model']:11} {r['N']}x{r['K']:<7} {r['M']:>2} {r['cublas_us']:>9} {r['table_us']:>9} "
              f"{r['best_us']:>8} {r['best_GB_per_s']:>6}  {r['best']}")
    for c in chains:
        print(f"{c['model']:11} step {c['chain']:<8} M={c['M']}: cuBLAS {c['cublas_ms']} ms ({c['cublas_TB_per_s']} TB/s), "
              f"GEMV {c['gemv_ms']} ms ({c['gemv_TB_per_s']} TB/s)")


if __name__ == "__main__":
    main()
