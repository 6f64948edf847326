"""Tune the MoE expert GEMMs for one shape on this GPU: for each batch size, time the Triton scan
layout and the sorted layout with every candidate tile (gate/up and down GEMMs separately, plus
the sorting pass and the sum over k), and torch's grouped GEMM; write what measured fastest to the
table `baryon/kernels/moe/tile_configs.py` reads. Routing is uniform over the experts (what
random weights give). Candidates compile in parallel worker processes first (Triton's disk
cache), then are timed one by one in this process.

    python benchmarks/tune_moe.py --experts 128 --hidden 2048 --inter 768 --top-k 8 [--batches 1 64 ...] [--out FILE]
    python benchmarks/tune_moe.py --weights int4 --batches 1 2 4 8 16 32 64 128 256 512   # packed int4 experts

`--weights int4` / `mxfp4` tunes packed 4-bit experts (GPTQ / AWQ / compressed-tensors W4A16, and
GPT-OSS's MXFP4) under their own key: random codes with group scales (and zero points), no
grouped-GEMM baseline (from 1,024 tokens those layers dequantize and take the bf16 table).

Prints one JSON line per batch size (each mode's best time) and a table last.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import torch

from baryon.kernels.activation import TritonSiluAndMul
from baryon.kernels.moe import experts_triton
from baryon.kernels.moe.align import align_pairs_triton
from baryon.kernels.moe.experts_grouped_mm import GroupedMMFusedExperts
from baryon.kernels.moe.tile_configs import MoETiles, TileConfig, config_file, shape_key
from baryon.kernels.quant.int4_experts import pack_int4_experts

BATCHES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192]
PAIRS_MAX_TOKENS = 8
SCAN_MAX_TOKENS = 256
SORTED_MIN_TOKENS = 16
PAIRS_TILES = [TileConfig(1, n, k, 1, warps, 3) for n in (4, 8, 16, 32) for k in (256, 512, 1024) for warps in (4, 8)]
SCAN_TILES = [TileConfig(16, n, k, 1, 4, stages) for n in (16, 32, 64) for k in (128, 256, 512) for stages in (2, 3)]
SORTED_TILES = [TileConfig(*t) for t in [
    (16, 64, 128, 1, 4, 3), (16, 128, 128, 1, 4, 3), (32, 64, 128, 8, 4, 3), (32, 128, 64, 8, 4, 4),
    (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3), (64, 128, 64, 8, 8, 4), (64, 256, 64, 8, 8, 3),
    (128, 64, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3)]] + [
    # gate/up without the fused activation: one accumulator, wider tiles, SiLU-and-mul after
    TileConfig(*t, fuse_act=False) for t in [(64, 128, 64, 8, 4, 4), (64, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4),
                                              (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4)]]


def _problem(args, tokens: int, device: torch.device):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, args.experts, generator=gen).argsort(dim=1)[:, :args.top_k].to(device, torch.int32)
    weights = torch.full((tokens, args.top_k), 1.0 / args.top_k, device=device)
    x = torch.randn(tokens, args.hidden, generator=gen).to(device, torch.bfloat16)
    inter = torch.randn(tokens * args.top_k, args.inter, generator=gen).to(device, torch.bfloat16)
    return x, inter, weights, ids


def _weights(args, device):
    """(w13, w2, their scales or None): bf16 experts, or packed 4-bit ones with their scales."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((args.experts, 2 * args.inter, args.hidden), (args.experts, args.hidden, args.inter))
    if args.weights == "bf16":
        w13, w2 = ((torch.randn(*shape, generator=gen) * 0.02).to(device, torch.bfloat16) for shape in shapes)
        return w13, w2, None
    packed = []
    for *rows, k in shapes:
        if args.weights == "int4":  # codes, scales and zero codes per 32 values
            codes = torch.randint(0, 16, (*rows, k), generator=gen, dtype=torch.int32).to(torch.uint8)
            scales = torch.rand(*rows, k // 32, generator=gen) * 0.002 + 0.001
            zeros = torch.randint(0, 16, (*rows, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
            blocks, scale = pack_int4_experts(codes, scales, zeros, torch.bfloat16)
        else:  # MXFP4: two e2m1 codes a byte, e8m0 scales near 2^-7
            blocks = torch.randint(0, 256, (*rows, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
            scale = torch.randint(118, 122, (*rows, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        packed.append((blocks.to(device), scale.to(device)))
    (w13, s13), (w2, s2) = packed
    return w13, w2, (s13, s2)


def _gemms(args, weights, tokens, problem, mode, cfg, layouts):
    """(gate/up launch, down launch) closures for one tile config."""
    w13, w2, scales = weights
    s13, s2 = scales or (None, None)
    int4 = args.weights == "int4"  # (read only with scales: packed 4-bit weights)
    x, inter, topk_weights, ids = problem
    num_pairs = ids.numel()
    up_out = torch.empty(num_pairs, args.inter, dtype=torch.bfloat16, device=x.device)
    down_out = torch.empty(num_pairs, args.hidden, dtype=torch.bfloat16, device=x.device)
    layout = (mode, ids, 0) if mode != "sorted" else ("sorted", *layouts[cfg.block_m], num_pairs)
    if cfg.fuse_act:
        up = lambda: experts_triton._launch(x, w13, up_out, args.inter, args.top_k, True, None, cfg, layout,  # noqa: E731
                                            mxfp4_scale=s13, int4=int4)
    else:
        gate_up = torch.empty(num_pairs, 2 * args.inter, dtype=torch.bfloat16, device=x.device)

        def up():
            experts_triton._launch(x, w13, gate_up, 2 * args.inter, args.top_k, False, None, cfg, layout,
                                   mxfp4_scale=s13, int4=int4)
            TritonSiluAndMul.forward(gate_up)
    down = lambda: experts_triton._launch(inter, w2, down_out, args.hidden, 1, False, topk_weights, cfg, layout,  # noqa: E731
                                          mxfp4_scale=s2, int4=int4)
    return up, down


# Packed 4-bit tiles put the weight rows on the MMA's tall side (BLOCK_N is its M): taller ones too.
FOUR_BIT_SCAN_TILES = [TileConfig(16, 128, k, 1, warps, stages) for k in (128, 256) for warps in (4, 8)
                       for stages in (2, 3)]
FOUR_BIT_SORTED_TILES = [TileConfig(*t) for t in [(16, 128, 128, 1, 8, 3), (32, 128, 128, 8, 8, 3),
                                                   (64, 128, 128, 8, 8, 3), (16, 256, 128, 1, 8, 3)]]


def _candidates(tokens: int, weights: str) -> list[tuple[str, TileConfig]]:
    four_bit = weights != "bf16"
    out = [("pairs", t) for t in PAIRS_TILES] if tokens <= PAIRS_MAX_TOKENS else []
    if tokens <= SCAN_MAX_TOKENS:
        out += [("scan", t) for t in SCAN_TILES + (FOUR_BIT_SCAN_TILES if four_bit else []) if t.fuse_act]
    if tokens >= SORTED_MIN_TOKENS:
        out += [("sorted", t) for t in SORTED_TILES + (FOUR_BIT_SORTED_TILES if four_bit else [])]
    return out


def _layouts(args, ids, device):
    return {bm: align_pairs_triton(ids, args.experts, 0, bm) for bm in {t.block_m for t in SORTED_TILES}}


def _compile_worker(args, worker: int, workers: int) -> None:
    """Run every candidate this worker owns once at every batch size (fills Triton's cache)."""
    device = torch.device("cuda")
    weights = _weights(args, device)
    jobs = [(tokens, mode, cfg) for tokens in args.batches for mode, cfg in _candidates(tokens, args.weights)]
    for tokens, mode, cfg in jobs[worker::workers]:
        problem = _problem(args, tokens, device)
        try:
            for fn in _gemms(args, weights, tokens, problem, mode, cfg, _layouts(args, problem[3], device)):
                fn()
        except Exception:  # a tile that does not fit (shared memory, registers) is left out below too
            pass
    torch.cuda.synchronize()


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3  # us


def tune(args) -> dict:
    device = torch.device("cuda")
    start = time.time()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_compile_worker, args=(args, i, args.workers)) for i in range(args.workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print(json.dumps({"compiled_in_s": round(time.time() - start, 1)}), flush=True)
    weights = _weights(args, device)
    table, rows = {}, []
    for tokens in args.batches:
        problem = _problem(args, tokens, device)
        layouts = _layouts(args, problem[3], device)
        num_pairs = problem[3].numel()
        y = torch.empty(num_pairs, args.hidden, dtype=torch.bfloat16, device=device)
        sum_us = _bench(lambda: experts_triton.sum_topk(y, tokens, args.top_k))
        align_us = {bm: _bench(lambda bm=bm: align_pairs_triton(problem[3], args.experts, 0, bm)) for bm in layouts}
        best = {}  # mode -> (us, up cfg, down cfg)
        parts_us = {}  # mode -> the best total's parts
        timed: dict[str, dict] = {mode: {"up": [], "down": []} for mode in ("pairs", "scan", "sorted")}
        for mode, cfg in _candidates(tokens, args.weights):
            try:
                up, down = _gemms(args, weights, tokens, problem, mode, cfg, layouts)
                timed[mode]["up"].append((_bench(up), cfg))
                timed[mode]["down"].append((_bench(down), cfg))
            except Exception:
                continue
        for mode, parts in timed.items():
            if not parts["up"]:
                continue
            for up_us, up_cfg in parts["up"]:
                for down_us, down_cfg in parts["down"]:
                    if not down_cfg.fuse_act:  # the flag only means something for gate/up
                        continue
                    total = up_us + down_us + sum_us
                    if mode == "sorted":
                        total += align_us[up_cfg.block_m] + (align_us[down_cfg.block_m]
                                                             if down_cfg.block_m != up_cfg.block_m else 0)
                    if mode not in best or total < best[mode][0]:
                        best[mode] = (total, up_cfg, down_cfg)
                        parts_us[mode] = {"up": round(up_us, 1), "down": round(down_us, 1), "sum": round(sum_us, 1),
                                          "align": round(total - up_us - down_us - sum_us, 1)}
        if not best and args.weights != "bf16":
            print(json.dumps({"tokens": tokens, "error": "no candidate ran"}), flush=True)
            continue
        if args.weights == "bf16":
            x, _, topk_weights, ids = problem
            w13, w2, _ = weights
            best["grouped_mm"] = (_bench(lambda: GroupedMMFusedExperts.forward(x, w13, w2, topk_weights, ids)),
                                  None, None)
        mode = min(best, key=lambda m: best[m][0])
        table[str(tokens)] = MoETiles(mode, best[mode][1], best[mode][2]).to_json()
        row = {"tokens": tokens, **{f"{m}_us": round(v[0], 1) for m, v in best.items()}, "chosen": mode,
               "parts_us": parts_us,
               "chosen_up": table[str(tokens)].get("up"), "chosen_down": table[str(tokens)].get("down")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'tokens':>6} {'pairs us':>9} {'scan us':>9} {'sorted us':>10} {'grouped_mm':>11}  chosen")
    for r in rows:
        cells = [f"{r.get(k, float('nan')):>{w}.1f}"
                 for k, w in (("pairs_us", 9), ("scan_us", 9), ("sorted_us", 10), ("grouped_mm_us", 11))]
        print(f"{r['tokens']:>6} {' '.join(cells)}  {r['chosen']}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES,
                        help="batch sizes to tune (a step takes the entry at or above its size)")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--weights", choices=("bf16", "int4", "mxfp4"), default="bf16",
                        help="the experts' weights: bf16, or packed 4-bit (tuned under their own key)")
    parser.add_argument("--out", default=None, help="table file to update (default: the one for this GPU)")
    args = parser.parse_args()
    if args.weights != "bf16":  # from that many tokens the 4-bit layers dequantize and take the bf16 table
        limit = {"int4": experts_triton.INT4_DEQUANTIZE_MIN_TOKENS,
                 "mxfp4": experts_triton.MXFP4_DEQUANTIZE_MIN_TOKENS}[args.weights]
        args.batches = [b for b in args.batches if b < limit]
    table = tune(args)
    out = args.out or config_file(torch.cuda.get_device_name())
    existing = json.load(open(out)) if os.path.isfile(out) else {}
    existing[shape_key(args.experts, args.hidden, args.inter,
                       torch.bfloat16 if args.weights == "bf16" else args.weights)] = table
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(existing, f, indent=1, sort_keys=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
