"""The tensor-parallel all-reduce on several GPUs: each `all_reduce` implementation (the one-shot
all-reduce over symmetric memory with and without the fused residual add + RMSNorm, NCCL's) at
decode and prefill message sizes, eager and replayed from a CUDA graph (what a decode step pays),
after checking its result against the float32 sum; "+norm": the all-reduce and the residual add
+ RMSNorm after it (one kernel in symm_mem_fused), graph-replayed. Then DP attention's exchanges
at `--exchange-tokens` rows a rank: the gather and reduce-scatter of symm_mem_fused's exchange
kernel against NCCL's all-gather and reduce-scatter (graph-replayed, results checked likewise),
the scatter's "+norm" with the next layer's residual add + RMSNorm.

    python benchmarks/all_reduce.py [--world-size 2] [--hidden 4096] [--tokens 1 8 64 256 1024] [--dtype bfloat16]
    python benchmarks/all_reduce.py --hidden 2048 --tokens 128 --exchange-tokens 64 128 256

One process per GPU; rank 0 prints a JSON line per (implementation, tokens) and a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GRAPH_CALLS = 64  # reductions captured back to back in one graph (as a step's layers)


def _ranks_in_step() -> None:
    """Start a timed loop on every rank together: a rank that is still compiling or capturing
    would otherwise make its peers' first calls wait (for the fused kernel, inside the timing)."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def _time_eager(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    _ranks_in_step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def _time_graph(fn, replays: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    _ranks_in_step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * GRAPH_CALLS)


def _record(rows: list[dict], rank: int, row: dict) -> None:
    """Keep a row for the table; rank 0 also prints it at once (a run cut short still tells)."""
    rows.append(row)
    if rank == 0:
        print(json.dumps({"bench": "all_reduce", "world_size": dist.get_world_size(), **row}), flush=True)


def _rank_main(rank: int, world: int, port: int, args, results) -> None:
    from baryon.kernels.all_reduce import SymmMemOneShotAllReduce, all_reduce_reference
    from baryon.kernels.all_reduce_rms_norm import all_reduce_add_rms_norm_reference
    from baryon.kernels.selector import candidates

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD
    dtype = getattr(torch, args.dtype)
    rows = []
    # Every reducer stays alive to the end, as in an engine (one reducer a group, for good). With
    # the earlier reducers freed and a new one made for the exchanges, the exchanges' first gather
    # on two H200s waited for its peer's rows until it gave up (a trap), while the same kernel
    # passed the two-GPU tests, whose reducers stay alive; a freed symmetric-memory block coming
    # back with its old peers' addresses is the suspicion (torch's rendezvous cache, keyed by
    # address before 2026-07), not confirmed; kernels/all_reduce.py now never frees a symmetric
    # buffer. The exchanges use the candidates' own fused reducer.
    reducers = []
    for cls in candidates("all_reduce"):
        if cls.unsupported_reason(device) or cls.cannot_implement_reason(world_size=world):
            continue
        # Every size through the implementation itself (the engine's one-shot stops at ONE_SHOT_MAX_BYTES).
        sized = {"max_bytes": max(args.tokens) * args.hidden * dtype.itemsize} \
            if issubclass(cls, SymmMemOneShotAllReduce) else {}
        reducer = cls.create(group, device, dtype, **sized)
        reducers.append(reducer)
        for tokens in args.tokens:
            generator = torch.Generator(device="cpu").manual_seed(1000 * tokens + rank)
            x = torch.randn(tokens, args.hidden, generator=generator).to(device=device, dtype=dtype)
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            out = reducer(x.clone())
            error = (out.float() - all_reduce_reference(parts).float()).abs().max().item()
            work = x.clone()
            eager = _time_eager(lambda: reducer(work))
            graphed = _time_graph(lambda: reducer(work))
            # The all-reduce with the residual add and RMSNorm after it (fused by symm_mem_fused).
            residual, weight = torch.ones_like(x), torch.ones(args.hidden, dtype=dtype, device=device)
            normed, _ = reducer.add_rms_norm(x.clone(), residual, weight, 1e-6)
            expected, _ = all_reduce_add_rms_norm_reference(parts, residual, weight, 1e-6)
            error = max(error, (normed.float() - expected.float()).abs().max().item())
            with_norm = _time_graph(lambda: reducer.add_rms_norm(work, residual, weight, 1e-6))
            _record(rows, rank, {"impl": reducer.name, "hidden": args.hidden, "tokens": tokens,
                                 "bytes": x.numel() * x.element_size(),
                                 "max_abs_error": error, "eager_us": round(eager, 2), "graph_us": round(graphed, 2),
                                 "with_norm_graph_us": round(with_norm, 2)})
    rows += _exchanges(rank, world, group, device, dtype, args, reducers)
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _exchanges(rank: int, world: int, group, device: torch.device, dtype: torch.dtype, args,
               reducers: list) -> list[dict]:
    """DP attention's gather and reduce-scatter: the exchange kernel against NCCL's collectives."""
    from baryon.kernels.all_reduce import all_reduce_reference
    from baryon.kernels.all_reduce_rms_norm import SymmMemFusedAllReduce, all_reduce_add_rms_norm_reference
    from baryon.kernels.selector import select

    fused = [r for r in reducers if isinstance(r, SymmMemFusedAllReduce)]  # its buffers serve any size
    if not fused or not args.exchange_tokens:
        return []
    reducer = fused[0]
    rows = []
    for tokens in args.exchange_tokens:
        generator = torch.Generator(device="cpu").manual_seed(7000 + 1000 * tokens + rank)
        x = torch.randn(tokens, args.hidden, generator=generator).to(device=device, dtype=dtype)
        whole = torch.randn(world * tokens, args.hidden, generator=generator).to(device=device, dtype=dtype)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        wholes = [torch.empty_like(whole) for _ in range(world)]
        dist.all_gather(wholes, whole)
        gathered = torch.empty(world * tokens, args.hidden, dtype=dtype, device=device)
        mine = torch.empty(tokens, args.hidden, dtype=dtype, device=device)
        expected_mine = all_reduce_reference([w[rank * tokens:(rank + 1) * tokens] for w in wholes])
        cases = {
            "gather:symm_mem_fused": (lambda: reducer.gather(x), torch.cat(parts)),
            "gather:nccl": (lambda: dist.all_gather_into_tensor(gathered, x, group=group) or gathered, torch.cat(parts)),
            "reduce_scatter:symm_mem_fused": (lambda: reducer.reduce_scatter(whole), expected_mine),
            "reduce_scatter:nccl": (lambda: dist.reduce_scatter_tensor(mine, whole, group=group) or mine, expected_mine),
        }
        # "+norm" of a scatter: with the next layer's residual add + RMSNorm (one kernel in
        # symm_mem_fused; NCCL's reduce-scatter, then the norm kernel)
        residual = torch.randn(tokens, args.hidden, generator=generator).to(device=device, dtype=dtype)
        weight = torch.randn(args.hidden, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)
        norm = select("rms_norm", device)
        with_norm = {
            "reduce_scatter:symm_mem_fused": lambda: reducer.reduce_scatter_add_rms_norm(whole, residual, weight, 1e-6),
            "reduce_scatter:nccl": lambda: norm.forward(dist.reduce_scatter_tensor(mine, whole, group=group) or mine,
                                                        weight, 1e-6, residual),
        }
        _, expected_residual = all_reduce_add_rms_norm_reference([w[rank * tokens:(rank + 1) * tokens] for w in wholes],
                                                                 residual, weight, 1e-6)
        for name, (fn, expected) in cases.items():
            error = (fn().float() - expected.float()).abs().max().item()
            sent = x if name.startswith("gather") else whole  # each rank's input
            norm_us = None
            if name in with_norm:
                error = max(error, (with_norm[name]()[1].float() - expected_residual.float()).abs().max().item())
                norm_us = round(_time_graph(with_norm[name]), 2)
            _record(rows, rank, {"impl": name, "hidden": args.hidden, "tokens": tokens,
                                 "bytes": sent.numel() * sent.element_size(),
                                 "max_abs_error": error, "eager_us": round(_time_eager(fn), 2),
                                 "graph_us": round(_time_graph(fn), 2), "with_norm_graph_us": norm_us})
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 128, 256, 512, 1024, 4096])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--exchange-tokens", type=int, nargs="*", default=[64, 128, 256],
                        help="rows a rank of DP attention's gather / reduce-scatter (none: skip them)")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"needs {args.world_size} GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank_main, args=(r, args.world_size, port, args, results))
                 for r in range(args.world_size)]
    for p in processes:
        p.start()
    rows = results.get(timeout=600)
    for p in processes:
        p.join()
    print(f"\nworld size {args.world_size}, hidden {args.hidden}")
    print(f"{'impl':<32}{'tokens':>8}{'KiB':>8}{'eager us':>10}{'graph us':>10}{'+norm us':>10}{'max err':>10}")
    for row in rows:
        norm = row["with_norm_graph_us"]
        print(f"{row['impl']:<32}{row['tokens']:>8}{row['bytes'] / 1024:>8.0f}{row['eager_us']:>10.2f}"
              f"{row['graph_us']:>10.2f}{'-' if norm is None else f'{norm:.2f}':>10}{row['max_abs_error']:>10.2g}")


if __name__ == "__main__":
    main()
