"""FP8 decode kernels on Qwen3-8B's projections (CUDA): per layer and token count, the weight-only
GEMV (`w8_gemv`), the activation quantization, cuBLAS's FP8 GEMM (`fp8_linear` scaled_mm), the
Triton FP8 GEMM and the swap-AB decode GEMM (`fp8_decode_linear`); then the 36 layers x 4 GEMVs of
a batch-1 decode step chained in one CUDA graph (each reads the previous one's output), which is
where programmatic dependent launch shows.

    python benchmarks/fp8_decode.py [--m 1 16 64] [--splits 1 2 4]
    python benchmarks/fp8_decode.py --sweep --m 64 128 256      # the decode GEMM's tiles against cuBLAS

Every time is a CUDA-graph replay (`triton.testing.do_bench_cudagraph`) over copies of the
weight that overflow the L2 cache, divided by the copies. One JSON line per case, then a table.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qkv, o, gate/up, down (N, K)
LAYERS = 36


def _bench(fn, copies: int = 1) -> float:
    """Microseconds per call."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3 / copies


def _fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from baryon.kernels.quant.act_quant import FP8

    return (torch.randn(n, k, device="cuda") * 40).clamp(-448, 448).to(FP8), torch.rand(n, device="cuda") * 1e-3


def layer_rows(ms: list[int], splits: list[int]) -> list[dict]:
    from baryon.kernels.quant.act_quant import FP8, TritonActQuant
    from baryon.kernels.quant.fp8_decode_gemm import MAX_M, TritonFp8DecodeLinear
    from baryon.kernels.quant.fp8_gemm import ScaledMMFp8Linear, TritonFp8Linear
    from baryon.kernels.quant.w8_gemv import MAX_M as GEMV_MAX_M
    from baryon.kernels.quant.w8_gemv import TritonW8Gemv

    rows = []
    for n, k in SHAPES:
        copies = max(1, int(256e6 // (n * k)))
        weights = [_fp8_weight(n, k) for _ in range(copies)]
        cublas = [ScaledMMFp8Linear.prepare(w, s) for w, s in weights]
        triton_gemm = [TritonFp8Linear.prepare(w, s) for w, s in weights]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_q, x_scale = TritonActQuant.per_token(x, FP8)
            row = {"N": n, "K": k, "M": m,
                   "act_quant": _bench(lambda: TritonActQuant.per_token(x, FP8)),
                   "cublas": _bench(lambda: [ScaledMMFp8Linear.forward(x_q, x_scale, p, torch.bfloat16)
                                             for p in cublas], copies),
                   "triton_gemm": _bench(lambda: [TritonFp8Linear.forward(x_q, x_scale, p, torch.bfloat16)
                                                  for p in triton_gemm], copies)}
            if m <= GEMV_MAX_M:
                row["gemv"] = _bench(lambda: [TritonW8Gemv.forward(x, w, s) for w, s in weights], copies)
            if m <= MAX_M:
                row["decode_gemm"] = _bench(lambda: [TritonFp8DecodeLinear.forward(x_q, x_scale, w, s, torch.bfloat16)
                                                     for w, s in weights], copies)
                for split in splits:  # K sliced over programs as given instead of `split_k`'s choice
                    row[f"decode_gemm_split{split}"] = _bench(lambda: [TritonFp8DecodeLinear.forward(
                        x_q, x_scale, w, s, torch.bfloat16, split=split) for w, s in weights], copies)
            row = {key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _sweep_tiles(m: int):
    """Candidate tiles of the decode GEMM for m tokens: token tiles from a quarter of the batch (at
    least 32) to all of it, 64 or 128 weight rows, 128 or 256 columns a step, 3 to 6 stages; those
    whose stages overflow shared memory are left out."""
    from baryon.kernels.quant.fp8_decode_gemm import DecodeTiles

    whole = max(16, 1 << (m - 1).bit_length())
    token_tiles = [b for b in (32, 64, 128, 256) if whole // 4 <= b <= whole]
    for bm, bn, bk, warps, stages in itertools.product(token_tiles, (64, 128), (128, 256), (4, 8), (3, 4, 6)):
        if stages * (bn * bk + bk * bm) <= 200 * 1024 and not (warps == 8 and bm * bn < 128 * 64):
            yield DecodeTiles(bm, bn, bk, warps, stages)


def sweep_rows(ms: list[int]) -> list[dict]:
    """Per layer and token count: cuBLAS, the table's tiles and the fastest candidate (with the split
    1, 2 or 4 slices)."""
    from baryon.kernels.quant.act_quant import TritonActQuant, FP8
    from baryon.kernels.quant.fp8_decode_gemm import TritonFp8DecodeLinear, tile_config
    from baryon.kernels.quant.fp8_gemm import ScaledMMFp8Linear

    rows = []
    for n, k in SHAPES:
        copies = max(1, int(256e6 // (n * k)))
        weights = [_fp8_weight(n, k) for _ in range(copies)]
        cublas = [ScaledMMFp8Linear.prepare(w, s) for w, s in weights]
        for m in ms:
            x_q, x_scale = TritonActQuant.per_token(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), FP8)
            row = {"N": n, "K": k, "M": m,
                   "cublas": _bench(lambda: [ScaledMMFp8Linear.forward(x_q, x_scale, p, torch.bfloat16)
                                             for p in cublas], copies),
                   "table": _bench(lambda: [TritonFp8DecodeLinear.forward(x_q, x_scale, w, s, torch.bfloat16)
                                            for w, s in weights], copies),
                   "table_tiles": list(tile_config(m, n, k))}
            best = None
            for tiles in _sweep_tiles(m):
                for split in (1, 2, 4):
                    try:
                        us = _bench(lambda: [TritonFp8DecodeLinear.forward(x_q, x_scale, w, s, torch.bfloat16,
                                                                           split=split, tiles=tiles)
                                             for w, s in weights], copies)
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                        print(json.dumps({"skipped": list(tiles), "error": str(e)[:120]}), flush=True)
                        break
                    if best is None or us < best[0]:
                        best = (us, list(tiles), split)
            row["best"], row["best_tiles"], row["best_split"] = best
            row = {key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'N x K':12} {'M':>4} {'cublas':>8} {'table':>8} {'best':>8}  best tiles (BM, BN, BK, warps, stages), split")
    for r in rows:
        print(f"{r['N']}x{r['K']:<7} {r['M']:>4} {r['cublas']:>8} {r['table']:>8} {r['best']:>8}  "
              f"{r['best_tiles']} {r['best_split']}")
    return rows


def chain_row() -> dict:
    """The batch-1 step's GEMVs in order, every layer its own weights (7 GB)."""
    from baryon.kernels.quant.w8_gemv import TritonW8Gemv

    layers = [[_fp8_weight(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    x0 = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        x = x0
        for layer in layers:
            for w, s in layer:
                x = TritonW8Gemv.forward(x[:, :w.shape[1]], w, s)  # [1, N]; a prefix of it feeds the next
        return x

    nbytes = LAYERS * sum(n * k for n, k in SHAPES)
    ms = _bench(step) / 1e3
    row = {"chain": f"{LAYERS} x {len(SHAPES)} GEMVs", "ms": round(ms, 4), "TB_per_s": round(nbytes / ms / 1e9, 3)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--splits", type=int, nargs="*", default=[],
                        help="also time the decode GEMM with K cut into this many slices")
    parser.add_argument("--sweep", action="store_true",
                        help="only the decode GEMM's candidate tiles against cuBLAS at each --m (> 16)")
    args = parser.parse_args()
    if args.sweep and args.splits:
        parser.error("--splits is for the per-layer table; --sweep tries 1, 2 and 4 slices itself")
    if args.sweep:
        sweep_rows(args.m)
        return
    rows = layer_rows(args.m, args.splits)
    chain = chain_row()
    columns = ("gemv", "act_quant", "cublas", "triton_gemm", "decode_gemm")
    print(f"\n{'N x K':12} {'M':>3} " + " ".join(f"{c:>11}" for c in columns) + "   (us per call)")
    for r in rows:
        print(f"{r['N']}x{r['K']:<7} {r['M']:>3} " + " ".join(f"{r.get(c, '-'):>11}" for c in columns))
    print(f"chained GEMVs of a batch-1 step: {chain['ms']} ms, {chain['TB_per_s']} TB/s")


if __name__ == "__main__":
    main()
