"""Time every kernel family's selected implementation on representative shapes.

    python benchmarks/kernels.py [--device cpu|cuda] [--dtype float32|bfloat16] [--small] [--only moe|mxfp4|int4|quant|mla|spec|block_quant|zentorch|token_bitmask|sampling|vocab_argmax|dense|linear_attention]
                                 [--graph-timer]

Prints one JSON line per (kernel, shape) with the median time in microseconds: host-timed single
calls with a device synchronisation (launch overhead included), or with --graph-timer (CUDA) the
time of the call captured in a CUDA graph and replayed (`triton.testing.do_bench_cudagraph`), which
is what a decode step under CUDA graphs pays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from baryon.kernels import selector
from baryon.kernels.attention.metadata import AttentionMetadata


def _time(fn, device: torch.device, repeats: int, graph: bool = False) -> float:
    if graph and device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _attention_case(device, dtype, num_seqs, q_len, seq_len, heads, kv_heads, head_dim, block_size=16):
    blocks_per_seq = -(-seq_len // block_size)
    cache = torch.randn(2, num_seqs * blocks_per_seq, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    tables = torch.arange(num_seqs * blocks_per_seq, device=device, dtype=torch.int32).view(num_seqs, -1)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    starts = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32)
    positions = torch.arange(seq_len - q_len, seq_len).repeat(num_seqs)
    seq_of_token = torch.arange(num_seqs).repeat_interleave(q_len)
    slots = tables.cpu()[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    metadata = AttentionMetadata(num_seqs * q_len, starts.to(device), seq_lens.to(device), tables,
                                 slots.to(device), q_len, seq_len, starts, seq_lens)
    tokens = num_seqs * q_len
    q = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
    kv = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
    return q, kv, cache, metadata


def vocab_argmax_kernels(record, device: torch.device, dtype: torch.dtype, rows: int, vocab: int) -> None:
    """A greedy step's token from the LM head's logits in the model dtype: the whole vocabulary (one
    GPU) and half of it (a rank's slice at TP=2: its candidates and their pick, the exchange
    between them not included), against torch's argmax."""
    gen = torch.Generator().manual_seed(0)
    for width in (vocab, vocab // 2):
        local = torch.randn(rows, width, generator=gen).to(device, dtype)
        shape = f"rows={rows} width={width}"
        record("torch.argmax", shape, lambda: local.argmax(dim=-1))
        for impl in selector.candidates("vocab_argmax"):
            if impl.unsupported_reason(device) is None:
                record(f"vocab_argmax.{impl.name}", shape, lambda: impl.argmax(local, width))


def dense_kernels(record, device: torch.device, dtype: torch.dtype, small: bool) -> None:
    """The 16-bit projections of a decode batch (CUDA): F.linear (cuBLAS) against the one-row GEMV
    (`dense_gemv`) and the decode GEMM (`dense_decode_linear`, at its table's tiles or its default
    ones) on one Qwen3-8B TP=2 rank's qkv and o (narrow: where cuBLAS launches few tiles)."""
    if device.type != "cuda":
        return
    from baryon.kernels.dense_decode_gemm import TritonDenseDecodeLinear
    from baryon.kernels.dense_gemv import TritonDenseGemv

    scale = 4 if small else 1
    for n, k in ((3072 // scale, 4096 // scale), (4096 // scale, 2048 // scale)):
        weight = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        for m in (1, 16, 64):
            x = torch.randn(m, k, device=device, dtype=dtype)
            record("dense_linear.cublas", f"M={m} N={n} K={k}", lambda: F.linear(x, weight))
            kernel = TritonDenseGemv if m == 1 else TritonDenseDecodeLinear
            record(f"{kernel.family}.triton", f"M={m} N={n} K={k}", lambda: kernel.forward(x, weight))


def sampling_kernels(record, device: torch.device, rows: int, vocab: int) -> None:
    """Every sampling implementation that runs on `device` (torch and Triton on CUDA), each logit
    processor on [rows, vocab] float32 logits as the sampler sees them."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(device)
    probs = logits.softmax(dim=-1)
    prompt_mask = (torch.rand(rows, vocab, generator=gen) < 0.01).to(device)
    output_counts = (torch.rand(rows, vocab, generator=gen) < 0.01).float().to(device)
    per_row = torch.full((rows,), 0.5, device=device)
    top_k = torch.full((rows,), 50, device=device)
    top_p = torch.full((rows,), 0.9, device=device)
    temperature = torch.full((rows,), 0.7, device=device)
    greedy = torch.zeros(rows, dtype=torch.bool, device=device)
    seeds = torch.randint(0, 1 << 62, (rows,), generator=gen).to(device)
    shape = f"rows={rows} vocab={vocab}"
    for impl in selector.candidates("sampling"):
        if impl.unsupported_reason(device) is not None:
            continue
        name = f"sampling.{impl.name}"
        record(name, f"penalties {shape}", lambda: impl.apply_penalties(logits, prompt_mask, output_counts,
                                                                        per_row, per_row, per_row + 1))
        record(name, f"top_k=50 {shape}", lambda: impl.apply_top_k_top_p(logits, top_k, None))
        record(name, f"top_p=0.9 {shape}", lambda: impl.apply_top_k_top_p(logits, None, top_p))
        record(name, f"top_k=50 top_p=0.9 {shape}", lambda: impl.apply_top_k_top_p(logits, top_k, top_p))
        record(name, f"min_p=0.5 {shape}", lambda: impl.apply_min_p(probs, per_row))
        # The draw: each row's token from its seed (reference: a generator per row, host-bound)
        record(name, f"sample_rows T=0.7 {shape}", lambda: impl.sample_rows(logits, temperature, greedy,
                                                                                      seeds))
    # The draw as the sampler made it before the race (softmax, stored noise, divide, argmax)
    record("sampling.softmax_noise_argmax", f"T=0.7 {shape}",
           lambda: ((logits / temperature.unsqueeze(1)).softmax(dim=-1)
                    / torch.empty_like(logits).exponential_()).argmax(dim=-1))


def token_bitmask_kernels(record, device: torch.device, vocab: int) -> None:
    """A grammar's allowed-token bitmask applied to [rows, vocab] float32 logits in place, by every
    implementation that runs on `device` and by xgrammar's own apply where it is installed: a
    sparse mask (1% of tokens allowed, as in most grammar states) and a dense one (half)."""
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 64):
        logits = torch.randn(rows, vocab, generator=gen).to(device)
        row_ids = torch.arange(rows, device=device)
        for density in (0.01, 0.5):
            allowed = torch.rand(rows, vocab, generator=gen) < density  # [rows, vocab]
            padded = torch.nn.functional.pad(allowed, (0, -vocab % 32)).view(rows, -1, 32).long()
            words = (padded << torch.arange(32)).sum(-1)  # [rows, ceil(vocab / 32)] in [0, 2**32)
            bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(device)
            shape = f"rows={rows} vocab={vocab} allowed={density:.0%}"
            for impl in selector.candidates("token_bitmask"):
                if impl.unsupported_reason(device) is None:
                    record(f"token_bitmask.{impl.name}", shape, lambda: impl.apply(logits, bitmask, row_ids))
            try:
                import xgrammar
            except ImportError:
                continue
            record("token_bitmask.xgrammar", shape, lambda: xgrammar.apply_token_bitmask_inplace(logits, bitmask))


def rejection_sampling_kernels(record, device: torch.device, vocab: int, small: bool) -> None:
    """The rejection rule of every implementation on `device` (the kernel alone), and the whole
    RejectionSampler (processing, draws, kernel) greedy and sampling, at batch 1, 8 and 64 with k = 4."""
    from baryon.layers.sampler import SamplingBatch
    from baryon.spec_decode.rejection_sampler import RejectionSampler

    k, gen = 4, torch.Generator().manual_seed(0)
    for batch in ((1, 8) if small else (1, 8, 64)):
        num_drafts, rows = batch * k, batch * (k + 1)
        cu_cpu = list(range(0, num_drafts + 1, k))
        cu = torch.tensor(cu_cpu, dtype=torch.int32, device=device)
        drafts = torch.randint(0, vocab, (num_drafts,), generator=gen).to(device)
        argmax = torch.randint(0, vocab, (rows,), generator=gen).to(device)
        p, u = torch.rand(num_drafts, generator=gen).to(device), torch.rand(num_drafts, generator=gen).to(device)
        recovered, bonus = drafts.clone(), argmax[:batch].clone()
        greedy = torch.zeros(batch, dtype=torch.bool, device=device)
        for impl in selector.candidates("rejection_sampling"):
            if impl.unsupported_reason(device) is None:
                record(f"rejection_sampling.{impl.name}", f"rule batch={batch} k={k}",
                       lambda: impl.rejection_sample(drafts, cu, argmax, p, p, u, recovered, bonus, greedy, k))
        logits = (torch.randn(rows, vocab, generator=gen) * 2).to(device)
        sampler = RejectionSampler(device, 0)
        for all_greedy in (True, False):
            sampling = SamplingBatch(
                temperature=torch.full((batch,), 0.8, device=device), greedy=torch.full((batch,), all_greedy, device=device),
                all_greedy=all_greedy, top_k=None, top_p=None, min_p=None, generators={}, penalties=None, banned=None,
                num_logprobs=None)
            record("rejection_sampler", f"{'greedy' if all_greedy else 'T=0.8'} batch={batch} k={k} vocab={vocab}",
                   lambda: sampler(logits, drafts, cu, cu_cpu, None, sampling))


def block_quant_kernels(record, device: torch.device) -> None:
    """The packed linears (SmolLM2-135M's gate_up, down and LM-head shapes), each C++ kernel
    (integer dots, exact float32) against F.linear on the same weights dequantized to float32 (what
    a dense model multiplies). CPU only."""
    import numpy as np

    from baryon.kernels.block_quant import CpuBlockQuantLinear, CpuInt8BlockQuantLinear, dequantize_rows, pack_rows

    rng = np.random.default_rng(0)
    kernels = [k for k in (CpuInt8BlockQuantLinear, CpuBlockQuantLinear) if k.unsupported_reason(device) is None]

    def halves(shape, scale):  # float16 values (so either pair width holds them exactly)
        return (rng.random(shape, dtype=np.float32) * scale).astype(np.float16).astype(np.float32)

    for bits, out_features, in_features in [(4, 3072, 576), (4, 576, 1536), (6, 576, 1536), (8, 49152, 576)]:
        low, high = {4: (0, 16), 6: (-32, 32), 8: (-128, 128)}[bits]
        codes = rng.integers(low, high, (out_features, in_features))
        if bits == 6:  # Q6_K: a scale per 16 weights, no offset
            scale, minimum = halves((out_features, in_features // 16), 0.01), None
        else:
            scale, minimum = halves((out_features, in_features // 32), 0.01), halves((out_features, in_features // 32), -0.05)
        # Float32 pairs (K-quants) and float16 ones (what GGUF's Q4_0/Q4_1/Q5_x/Q8_0 store).
        for pair_bytes in (8, 4) if bits != 6 else (8,):
            packed = pack_rows(codes, scale, minimum, bits, pair_bytes)
            dense = dequantize_rows(packed, in_features, bits)
            for rows in (1, 16, 128):
                x = torch.randn(rows, in_features)
                shape = f"x={rows}x{in_features} w={out_features}x{in_features} q{bits} {'f16' if pair_bytes == 4 else 'f32'} pairs"
                for kernel in kernels:
                    record(f"block_quant_linear.{kernel.name}", shape, lambda: kernel.forward(x, packed, bits, in_features))
                if pair_bytes == 8:
                    record("linear.dense_float32", shape, lambda: torch.nn.functional.linear(x, dense))


def zentorch_kernels(record, device: torch.device) -> None:
    """zentorch's ops (the `.[zen]` extra) against ours on SmolLM2-135M's shapes, CPU only: dense
    linear (float32, and bfloat16 where the CPU has avx512_bf16), dynamic int8 linear, int4
    weight-only linear, embedding and causal attention. An op this CPU or install cannot run is
    printed with the reason instead of a time."""

    from baryon.kernels.cpu.zentorch_support import cpu_flags, zentorch_unavailable_reason
    from baryon.kernels.quant.int8_gemm import dequantize_int8_weights, prepare_int8_weights
    from baryon.quantization.int8 import quantize_int8_per_channel

    def able(ops: tuple[str, ...], isa: tuple[str, ...]) -> bool:
        reason = zentorch_unavailable_reason(device, ops, isa)
        if reason:
            print(json.dumps({"kernel": f"zentorch.{ops[0]}", "skipped": reason}), flush=True)
        return reason is None

    zt = torch.ops.zentorch
    print(json.dumps({"cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))}), flush=True)
    shapes = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]
    dtypes = [torch.float32] + ([torch.bfloat16] if "avx512_bf16" in cpu_flags() else [])
    for dtype in dtypes:
        for n, k in shapes:
            w = torch.randn(n, k).to(dtype)
            for rows in (1, 16, 128):
                x = torch.randn(rows, k).to(dtype)
                shape = f"x={rows}x{k} w={n}x{k} {str(dtype).split('.')[1]}"
                record("dense_linear.torch", shape, lambda: F.linear(x, w))
                if able(("zentorch_linear_unary",), ("avx2",) + (("avx512_bf16",) if dtype == torch.bfloat16 else ())):
                    record("dense_linear.zentorch", shape, lambda: zt.zentorch_linear_unary(x, w, None))
    for n, k in shapes:  # W8A8: the torch kernel dequantizes per call (our CPU path today)
        weights = prepare_int8_weights(*quantize_int8_per_channel(torch.randn(n, k)))
        for rows in (1, 16, 128):
            x = torch.randn(rows, k)
            shape = f"x={rows}x{k} w={n}x{k} int8"
            record("int8_linear.torch", shape, lambda: F.linear(x, dequantize_int8_weights(weights)))
            if able(("zentorch_dynamic_qlinear",), ("avx512f", "avx512bw", "avx512_vnni")):
                record("int8_linear.zentorch", shape,
                       lambda: zt.zentorch_dynamic_qlinear(x, weights.w_q, weights.w_scale, None))
    for n, k in shapes:  # int4 weight-only, groups of 32, bfloat16 activations
        codes = torch.randint(-8, 8, (n, k), dtype=torch.int8)
        scales = torch.rand(k // 32, n).to(torch.bfloat16) * 0.01
        dense = (codes.float() * scales.float().t().repeat_interleave(32, 1)).to(torch.bfloat16)
        for rows in (1, 16, 128):
            x = torch.randn(rows, k).to(torch.bfloat16)
            shape = f"x={rows}x{k} w={n}x{k} int4 g32 bfloat16"
            record("w4a16_linear.torch_dequantized", shape, lambda: F.linear(x, dense))
            if able(("zentorch_woq_linear", "zentorch_woq_repack_weight"), ("avx512f", "avx512_bf16")):
                packed = zt.zentorch_woq_repack_weight(codes).t()
                record("w4a16_linear.zentorch", shape, lambda: zt.zentorch_woq_linear(x, packed, scales, None, None))
    table = torch.randn(49152, 576)
    for rows in (1, 16, 128):
        ids = torch.randint(0, 49152, (rows,))
        record("embedding.torch", f"ids={rows} table=49152x576", lambda: F.embedding(ids, table))
        if able(("zentorch_embedding",), ("avx2",)):
            record("embedding.zentorch", f"ids={rows} table=49152x576", lambda: zt.zentorch_embedding(table, ids))
    for length in (128, 512):  # a fresh prompt, 9 query heads over 3 KV heads of 64
        q, kv, cache, md = _attention_case(device, torch.float32, 1, length, length, 9, 3, 64)
        shape = f"prefill q={length} kv={length} heads=9/3 d=64"
        for impl in selector.candidates("attention"):
            if impl.unsupported_reason(device) is None:
                attention = impl(9, 64, 3, 0.125, None)
                record(f"attention.{impl.name}", shape, lambda: attention.forward(q, kv, kv, cache, md))
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, 9, L, 64]
        kh = kv.transpose(0, 1).unsqueeze(0).repeat_interleave(3, dim=1)
        record("sdpa.torch", shape, lambda: F.scaled_dot_product_attention(qh, kh, kh, is_causal=True))
        if able(("zentorch_sdpa",), ("avx2",)):
            record("sdpa.zentorch", shape, lambda: zt.zentorch_sdpa(qh, kh, kh, is_causal=True))


def _latent_cache_case(device, dtype, num_seqs: int, q_len: int, seq_len: int, width: int, block_size: int):
    """A random paged latent cache [blocks, block_size, width] holding num_seqs sequences of seq_len
    tokens, and the metadata of q_len new tokens each (stored nowhere)."""
    blocks_per_seq = -(-seq_len // block_size)
    cache = torch.randn(num_seqs * blocks_per_seq, block_size, width, device=device, dtype=dtype)
    tables = torch.arange(num_seqs * blocks_per_seq, device=device, dtype=torch.int32).view(num_seqs, -1)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    starts = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32)
    metadata = AttentionMetadata(num_seqs * q_len, starts.to(device), seq_lens.to(device), tables,
                                 torch.full((num_seqs * q_len,), -1, device=device, dtype=torch.int64),
                                 q_len, seq_len, starts, seq_lens)
    return cache, metadata


def mla_kernels(record, device: torch.device, dtype: torch.dtype, small: bool) -> None:
    """Latent attention over the paged latent cache (DeepSeek-V2-Lite: 16 heads, rank 512, rope 64):
    decode at batch 1 and 64 over 1k-32k tokens of context and at nano's full batch (256 x 640), and
    a 4096-token prefill; the JSON line after each gives the cache bytes read per microsecond."""
    heads, rank, rope = (4, 64, 16) if small else (16, 512, 64)
    block_size = 16
    cases = [("decode", 1, 1, 1024), ("decode", 1, 1, 32768), ("decode", 64, 1, 1024), ("decode", 64, 1, 8192),
             ("decode", 256, 1, 640), ("prefill", 1, 4096, 4096)]  # 256 x 640: a full nano batch
    if small:
        cases = [("decode", 1, 1, 256), ("decode", 8, 1, 128), ("prefill", 1, 64, 64)]
    for kind, num_seqs, q_len, seq_len in cases:
        cache, metadata = _latent_cache_case(device, dtype, num_seqs, q_len, seq_len, rank + rope, block_size)
        q_latent = torch.randn(num_seqs * q_len, heads, rank, device=device, dtype=dtype)
        q_pe = torch.randn(num_seqs * q_len, heads, rope, device=device, dtype=dtype)
        for impl in selector.candidates("mla_attention"):
            if impl.unsupported_reason(device) is not None or (impl.name == "torch" and seq_len > 8192):
                continue
            backend = impl(heads, rank, rope, (128 + rope) ** -0.5)
            us = record(f"mla_attention.{impl.name}", f"{kind} seqs={num_seqs} q={q_len} kv={seq_len} heads={heads}",
                        lambda: backend.forward(q_latent, q_pe, cache, metadata))
            cache_bytes = num_seqs * seq_len * (rank + rope) * cache.element_size()
            print(json.dumps({"cache_GB_per_s": round(cache_bytes / us / 1e3, 1)}), flush=True)


def mla_indexer_kernels(record, device: torch.device, dtype: torch.dtype, small: bool) -> None:
    """DeepSeek-V3.2's lightning indexer (64 index heads of 128, top-2048) over a cache row of
    latent + rope + index key (512 + 64 + 128), in the model dtype and as FP8
    (kv_cache_dtype="fp8"): decode at batch 1 and 64 over 8k tokens of context, a 2048-token prefill."""
    heads, dim, rank, topk = (8, 32, 64, 64) if small else (64, 128, 512 + 64, 2048)
    block_size = 64
    cases = [(1, 1, 256), (8, 1, 128), (1, 64, 64)] if small else [(1, 1, 8192), (64, 1, 8192), (1, 2048, 2048)]
    for num_seqs, q_len, seq_len in cases:
        cache, metadata = _latent_cache_case(device, dtype, num_seqs, q_len, seq_len, rank + dim, block_size)
        index_q = torch.randn(num_seqs * q_len, heads, dim, device=device, dtype=dtype)
        weights = torch.randn(num_seqs * q_len, heads, device=device, dtype=torch.float32)
        for cache_name, kv in (("model dtype", cache), ("fp8", cache.clamp(-448, 448).to(torch.float8_e4m3fn))):
            for impl in selector.candidates("mla_indexer"):
                if impl.unsupported_reason(device) is not None or (impl.name == "torch" and seq_len > 2048):
                    continue
                record(f"mla_indexer.{impl.name}", f"seqs={num_seqs} q={q_len} kv={seq_len} heads={heads} "
                       f"topk={topk} cache={cache_name}",
                       lambda: impl.forward(index_q, weights, kv, rank, metadata, topk))


def moe_kernels(record, device: torch.device, dtype: torch.dtype, small: bool) -> None:
    """Qwen3-30B-A3B's MoE layer (128 experts, top-8, hidden 2048, expert intermediate 768):
    routing, and each expert-GEMM implementation that runs here, at decode batches (1-64 tokens)
    and a prefill chunk (8192 tokens). Routing is uniform over the experts, as with random weights."""
    from baryon.kernels.moe.routing import RoutingConfig

    experts, top_k, hidden, inter = (16, 4, 256, 128) if small else (128, 8, 2048, 768)
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(device, dtype)
    routing = RoutingConfig(experts, top_k, renormalize=True)
    for impl in selector.candidates("moe_routing"):
        if impl.unsupported_reason(device) is None:
            for tokens in (1, 64, 8192 // (16 if small else 1)):
                logits = torch.randn(tokens, experts, generator=gen).to(device)
                record(f"moe_routing.{impl.name}", f"tokens={tokens} E={experts} top{top_k}",
                       lambda: impl.forward(logits, routing))
    # The sorted GEMM's layout of a step's pairs: every expert (one rank) and half of them (EP=2).
    from baryon.kernels.moe.align import align_pairs, align_pairs_triton

    # On CUDA the Triton one only: the torch reference syncs with the host (not graph-capturable).
    aligners = [("triton", align_pairs_triton)] if device.type == "cuda" else [("torch", align_pairs)]
    for tokens in (64, 256, 8192 // (16 if small else 1)):
        ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(device, torch.int32)
        for local in (experts, experts // 2):
            for name, align in aligners:
                record(f"moe_align.{name}", f"tokens={tokens} top{top_k} local experts={local}/{experts} block_m=64",
                       lambda: align(ids, local, 0, 64))
    for impl in selector.candidates("fused_moe"):
        if impl.unsupported_reason(device) is not None or impl.cannot_implement_reason(
                dtype=dtype, hidden=hidden, inter=inter, device_type=device.type) is not None:
            continue
        sizes = (1, 4, 16, 64, 8192 // (16 if small else 1))
        if impl.name == "torch" and device.type == "cuda":
            sizes = (1, 64)  # the per-expert loop: a reference, not a contender
        for tokens in sizes:
            x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(device, torch.int32)
            weights = torch.full((tokens, top_k), 1.0 / top_k, device=device)
            weight_bytes = ids.unique().numel() * 3 * hidden * inter * w13.element_size()
            us = record(f"fused_moe.{impl.name}", f"tokens={tokens} E={experts} top{top_k} H={hidden} I={inter}",
                        lambda: impl.forward(x, w13, w2, weights, ids))
            results_extra = {"expert_weight_GB_per_s": round(weight_bytes / us / 1e3, 1),
                             "TFLOP_per_s": round(6 * tokens * top_k * hidden * inter / us / 1e6, 1)}
            print(json.dumps(results_extra), flush=True)


def mxfp4_moe_kernels(record, device: torch.device, dtype: torch.dtype, small: bool) -> None:
    """GPT-OSS-20B's MoE layer (32 experts, top-4, hidden 2880, intermediate 2880, biases, clamped
    SwiGLU): the MXFP4 expert kernels (packed weights: 4.25 bits a value) and the bf16 kernels on
    the same experts dequantized, at decode batches and a prefill chunk; uniform routing."""
    from baryon.kernels.moe.expert_activation import ExpertActivation
    from baryon.kernels.quant.mxfp4 import GROUP, dequantize_mxfp4

    experts, top_k, hidden, inter = (8, 4, 256, 256) if small else (32, 4, 2880, 2880)
    gen = torch.Generator().manual_seed(0)

    def packed(n: int, k: int):
        blocks = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.int32).to(device, torch.uint8)
        return blocks, torch.full((experts, n, k // GROUP), 120, device=device, dtype=torch.uint8)

    w13, w13_s = packed(2 * inter, hidden)
    w2, w2_s = packed(hidden, inter)
    extras = dict(w13_bias=torch.zeros(experts, 2 * inter, device=device, dtype=dtype),
                  w2_bias=torch.zeros(experts, hidden, device=device, dtype=dtype),
                  activation=ExpertActivation("clamped_swiglu"))
    w13_f, w2_f = dequantize_mxfp4(w13, w13_s, dtype), dequantize_mxfp4(w2, w2_s, dtype)
    mx = selector.select("fused_moe_mxfp4", device, dtype=dtype, hidden=hidden, inter=inter)
    dense = selector.select("fused_moe", device, dtype=dtype, hidden=hidden, inter=inter, device_type=device.type,
                            biased=True, activation="clamped_swiglu")
    for tokens in (1, 4, 16, 64, 8192 // (16 if small else 1)):
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(device, torch.int32)
        weights = torch.full((tokens, top_k), 1.0 / top_k, device=device)
        shape = f"tokens={tokens} E={experts} top{top_k} H={hidden} I={inter}"
        read = ids.unique().numel() * 3 * hidden * inter
        us = record(f"fused_moe_mxfp4.{mx.name}", shape,
                    lambda: mx.forward(x, w13, w2, w13_s, w2_s, weights, ids, **extras))
        dense_us = record(f"fused_moe.{dense.name} (the same experts in {str(dtype).split('.')[1]})", shape,
                          lambda: dense.forward(x, w13_f, w2_f, weights, ids, **extras))
        print(json.dumps({"mxfp4_expert_GB_per_s": round(read * 17 / 32 / us / 1e3, 1),
                          "bf16_expert_GB_per_s": round(read * 2 / dense_us / 1e3, 1),
                          "mxfp4_TFLOP_per_s": round(6 * tokens * top_k * hidden * inter / us / 1e6, 1)}), flush=True)


def int4_moe_kernels(record, device: torch.device, dtype: torch.dtype, small: bool) -> None:
    """Qwen3-30B-A3B's MoE layer (128 experts, top-8, hidden 2048, intermediate 768) as a GPTQ /
    AWQ / W4A16 checkpoint holds it: the int4 expert kernels (packed codes, a (scale, zero) pair
    per 32 values: 5 bits a value) against the bf16 kernels on the same experts dequantized, at
    decode batches and a prefill chunk; uniform routing."""
    from baryon.kernels.quant.int4_experts import dequantize_int4_experts, pack_int4_experts

    experts, top_k, hidden, inter = (16, 4, 256, 128) if small else (128, 8, 2048, 768)
    gen = torch.Generator().manual_seed(0)

    def packed(n: int, k: int):
        codes = torch.randint(0, 16, (experts, n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
        scales = torch.rand(experts, n, k // 128, generator=gen) * 0.01  # groups of 128
        zeros = torch.full((experts, n, k // 128), 8, dtype=torch.uint8)
        return [t.to(device) for t in pack_int4_experts(codes, scales, zeros, dtype)]

    (w13, w13_p), (w2, w2_p) = packed(2 * inter, hidden), packed(hidden, inter)
    w13_f, w2_f = dequantize_int4_experts(w13, w13_p, dtype), dequantize_int4_experts(w2, w2_p, dtype)
    int4 = selector.select("fused_moe_int4", device, dtype=dtype, hidden=hidden, inter=inter)
    dense = selector.select("fused_moe", device, dtype=dtype, hidden=hidden, inter=inter, device_type=device.type)
    for tokens in (1, 4, 16, 64, 8192 // (16 if small else 1)):
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(device, torch.int32)
        weights = torch.full((tokens, top_k), 1.0 / top_k, device=device)
        shape = f"tokens={tokens} E={experts} top{top_k} H={hidden} I={inter}"
        read = ids.unique().numel() * 3 * hidden * inter
        us = record(f"fused_moe_int4.{int4.name}", shape, lambda: int4.forward(x, w13, w2, w13_p, w2_p, weights, ids))
        dense_us = record(f"fused_moe.{dense.name} (the same experts in {str(dtype).split('.')[1]})", shape,
                          lambda: dense.forward(x, w13_f, w2_f, weights, ids))
        print(json.dumps({"int4_expert_GB_per_s": round(read * 5 / 8 / us / 1e3, 1),
                          "bf16_expert_GB_per_s": round(read * 2 / dense_us / 1e3, 1)}), flush=True)


QUANT_SCHEMES = ("dense", "fp8-channel", "fp8-block", "w8a8", "w4a16")


def quantized_layer(scheme: str, n: int, k: int, device: torch.device, dtype: torch.dtype):
    """A linear layer [n, k] holding random weights in `scheme`'s layout, as the engine builds it
    (the method's own parameters, loaded then repacked), so its forward is the model's: the
    activation quantization plus the GEMM."""
    from baryon.layers.linear import ReplicatedLinear
    from baryon.loader.quantized import process_weights_after_loading
    from baryon.quantization.fp8 import Fp8LinearMethod
    from baryon.quantization.int8 import Int8LinearMethod
    from baryon.quantization.wna16 import WNA16LinearMethod

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.no_grad():
            layer = ReplicatedLinear(k, n, bias=False)
            method = {"dense": None, "fp8-channel": Fp8LinearMethod("channel", False, online=True),
                      "fp8-block": Fp8LinearMethod("block", False, (128, 128), scale_name="weight_scale_inv"),
                      "w8a8": Int8LinearMethod(online=True), "w4a16": WNA16LinearMethod("online", 4, 128)}[scheme]
            if method is not None:
                layer.use_method(method)
            for name, param in layer.named_parameters():
                if "scale" in name:
                    param.fill_(0.02 / 448)
                else:
                    param.copy_(torch.randn(param.shape) * (1 if param.element_size() == 1 else 0.02))
            process_weights_after_loading(layer)
    finally:
        torch.set_default_dtype(previous)
    return layer


def quant_kernels(record, device: torch.device, dtype: torch.dtype, small: bool) -> None:
    """Each quantized linear layout against the dense one on Qwen3-8B's projections (qkv 6144 x
    4096, gate/up 24576 x 4096, down 4096 x 12288) at M = 1, 16, 64 and 4096 tokens; the JSON
    line after each timing gives the weight bandwidth and the arithmetic rate."""
    shapes = [(384, 256), (512, 768)] if small else [(6144, 4096), (24576, 4096), (4096, 12288)]
    for n, k in shapes:
        for scheme in QUANT_SCHEMES:
            try:
                layer = quantized_layer(scheme, n, k, device, dtype)
            except ValueError as e:  # no kernel serves it here
                print(json.dumps({"kernel": f"linear.{scheme}", "shape": f"{n}x{k}", "skipped": str(e)}))
                continue
            weight_bytes = n * k * {"dense": torch.finfo(dtype).bits // 8, "w4a16": 0.5}.get(scheme, 1)
            # Copies of the layer called in turn, so that together they overflow the L2 cache
            # (50 MB on an H100) and every call reads its weight from memory, as a model does.
            layers = [layer] + [quantized_layer(scheme, n, k, device, dtype)
                                for _ in range(int(256e6 // weight_bytes) if device.type == "cuda" else 0)]
            for m in (1, 16, 64) if small else (1, 16, 64, 4096):
                x = torch.randn(m, k, device=device, dtype=dtype)
                us = record(f"linear.{scheme}", f"M={m} N={n} K={k}",
                            lambda: [each(x) for each in layers], per_call=len(layers))
                print(json.dumps({"weight_GB_per_s": round(weight_bytes / us / 1e3, 1),
                                  "TFLOP_per_s": round(2 * m * n * k / us / 1e6, 1)}), flush=True)


def long_context_kernels(record, device: torch.device, dtype: torch.dtype, small: bool) -> None:
    """Issue 19: attention at long contexts, Qwen3-8B's heads (32 query, 8 KV, 128 wide), batch 1.
    Prefill of a fresh prompt (causal): the selected paged kernel against PyTorch's fused SDPA
    backends on the same q/k/v (cuDNN, flash), TFLOP/s counting the causal half; decode over the
    paged cache (the selector's split count), GB/s of K and V read."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads, head_dim = 32, 8, 128
    attention = selector.select("attention", device)
    for seq_len in ((256, 1024) if small else (2048, 16384, 32768)):
        q, kv, cache, md = _attention_case(device, dtype, 1, seq_len, seq_len, heads, kv_heads, head_dim)
        impl = attention(heads, head_dim, kv_heads, head_dim ** -0.5, None)
        flops = 4 * heads * head_dim * seq_len * seq_len / 2
        us = record(f"attention.{attention.name}", f"prefill q={seq_len} kv={seq_len} causal",
                    lambda: impl.forward(q, kv, kv, cache, md))
        print(json.dumps({"kernel": f"attention.{attention.name}", "seq_len": seq_len, "tflops": round(flops / us / 1e6, 3)}))
        q4 = q.transpose(0, 1).unsqueeze(0)  # [1, heads, seq, dim]
        k4 = torch.randn(1, kv_heads, seq_len, head_dim, device=device, dtype=dtype)
        v4 = torch.randn_like(k4)
        backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)] \
            if device.type == "cuda" else [("math", SDPBackend.MATH)]
        for label, backend in backends:
            def sdpa():
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
            try:
                us = record(f"sdpa.{label}", f"prefill q={seq_len} kv={seq_len} causal", sdpa)
            except RuntimeError as error:  # a backend this build or shape lacks
                print(json.dumps({"kernel": f"sdpa.{label}", "seq_len": seq_len, "error": str(error)[:200]}))
                continue
            print(json.dumps({"kernel": f"sdpa.{label}", "seq_len": seq_len, "tflops": round(flops / us / 1e6, 3)}))
    for seq_len in ((1024, 4096) if small else (16384, 32768, 131072)):
        q, kv, cache, md = _attention_case(device, dtype, 1, 1, seq_len, heads, kv_heads, head_dim)
        impl = attention(heads, head_dim, kv_heads, head_dim ** -0.5, None)
        us = record(f"attention.{attention.name}", f"decode q=1 kv={seq_len}", lambda: impl.forward(q, kv, kv, cache, md))
        kv_bytes = 2 * seq_len * kv_heads * head_dim * cache.element_size()
        print(json.dumps({"kernel": f"attention.{attention.name}", "decode_kv": seq_len, "gb_per_s": round(kv_bytes / us / 1e3, 1)}))


def linear_attention_kernels(record, device: torch.device, dtype: torch.dtype, small: bool) -> None:
    """Gated DeltaNet's token mixing and its gated output norm at Qwen3-Next-80B-A3B's widths (16
    key heads, 32 value heads of 128, convolution width 4 over 8192 channels), per implementation
    that runs on `device`:
    decode batches of 1 and 64 (each a sequence of 1k tokens with its states), one prefill of 4096
    new tokens and eight of 2048 (the prefill workload's step; --small: 128 each), and single
    prompts of 128, 512 and 1024 (where the chunked form starts to pay)."""
    hk, hv, dim, width = 16, 32, 128, 4
    channels = 2 * hk * dim + hv * dim
    shapes = ((1, 1), (64, 1), (1, 128), (8, 128)) if small else \
        ((1, 1), (64, 1), (1, 4096), (8, 2048), (1, 128), (1, 512), (1, 1024))
    for num_seqs, q_len in shapes:
        tokens = num_seqs * q_len
        qkv = torch.randn(tokens, channels, device=device, dtype=dtype)
        a = torch.randn(tokens, hv, device=device, dtype=dtype)
        b = torch.randn(tokens, hv, device=device, dtype=dtype)
        a_log = torch.zeros(hv, device=device)
        dt_bias = torch.zeros(hv, device=device)
        weight = torch.randn(channels, width, device=device, dtype=dtype) * 0.1
        conv_states = torch.zeros(num_seqs, width - 1, channels, device=device, dtype=dtype)
        states = torch.zeros(num_seqs, hv, dim, dim, device=device)
        starts = torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device=device)
        seq_lens = torch.full((num_seqs,), 1024 if q_len == 1 else q_len, dtype=torch.int32, device=device)
        slots = torch.arange(num_seqs, dtype=torch.int32, device=device)
        shape = f"seqs={num_seqs} new_tokens={q_len} heads={hk}/{hv}x{dim} conv={channels}x{width}"
        core = torch.randn(tokens, hv, dim, device=device, dtype=dtype)  # the rule's output [T, Hv, Dv]
        gate = qkv[:, :hv * dim].view(tokens, hv, dim)  # (strided, as z in its projection)
        norm_weight = torch.ones(dim, device=device, dtype=dtype)
        for family in ("causal_conv1d", "gated_delta_rule", "gated_rms_norm"):
            for impl in selector.candidates(family):
                host_bound = impl.name == "torch" and family != "gated_rms_norm"
                if impl.unsupported_reason(device) is not None or (host_bound and (device.type == "cuda" or q_len > 128)):
                    continue  # (the reference reads the layout on the host and walks a prefill token by token)
                if family == "causal_conv1d":
                    call = lambda: impl.forward(qkv, weight, None, conv_states, starts, seq_lens, slots, q_len)
                elif family == "gated_rms_norm":
                    call = lambda: impl.forward(core, gate, norm_weight, 1e-6)
                else:
                    call = lambda: impl.forward(qkv, a, b, a_log, dt_bias, states, starts, seq_lens, slots,
                                                hk, dim, q_len)
                if family == "gated_delta_rule" and impl.name == "triton":
                    sweep_delta_rule_tiles(record, f"{family}.{impl.name}", shape, call, q_len)
                    continue
                record(f"{family}.{impl.name}", shape, call)


def sweep_delta_rule_tiles(record, name: str, shape: str, call, q_len: int) -> None:
    """The Triton delta rule with its own choice of form and tiles, then each form's tiles swept
    (the token walk's at every batch; the chunked form's, and the walk for comparison, at prefills)."""
    import baryon.kernels.delta_rule_chunked_triton as chunked
    import baryon.kernels.linear_attention_triton as lt

    chosen = lt.delta_rule_tiles, chunked.CHUNKED_TILES, lt.CHUNKED_MIN_QUERY_LEN, lt.CHUNKED_MAX_PAIRS
    record(name, shape, call)
    lt.CHUNKED_MIN_QUERY_LEN = 1 << 30  # the token walk
    for block_v, warps in ((16, 1), (32, 1), (32, 4), (64, 2)):
        lt.delta_rule_tiles = lambda *_, tiles=(block_v, warps): tiles
        record(f"{name}.walk.block_v{block_v}.warps{warps}", shape, call)
    lt.delta_rule_tiles, lt.CHUNKED_MIN_QUERY_LEN, lt.CHUNKED_MAX_PAIRS = chosen[0], 1, 1 << 30
    if q_len > 1:  # the chunked form's state pass (value block x warps) and outputs (the same)
        for tiles in ((32, 4, 32, 4), (32, 4, 64, 4), (16, 4, 32, 4), (64, 4, 32, 4), (32, 8, 32, 8)):
            chunked.CHUNKED_TILES = tiles
            record(f"{name}.chunked.state{tiles[0]}x{tiles[1]}.out{tiles[2]}x{tiles[3]}", shape, call)
        chunked.CHUNKED_TILES = chosen[1]
        for warps in (4, 16):
            chunked.PREPARE_WARPS = warps
            record(f"{name}.chunked.prepare_warps{warps}", shape, call)
        chunked.PREPARE_WARPS = 8
    lt.CHUNKED_MIN_QUERY_LEN, lt.CHUNKED_MAX_PAIRS = chosen[2], chosen[3]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--small", action="store_true", help="small shapes (fast on a laptop CPU)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", choices=["moe", "mxfp4", "int4", "quant", "mla", "spec", "block_quant", "zentorch",
                                           "token_bitmask", "long_context", "sampling", "vocab_argmax", "dense",
                                           "linear_attention"],
                        help="just these kernel families")
    parser.add_argument("--graph-timer", action="store_true",
                        help="CUDA: time each call replayed from a CUDA graph (no launch overhead)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    scale = 4 if args.small else 1
    heads, kv_heads, head_dim, hidden, vocab = 32, 8, 128, 4096, 151936
    results = []

    def record(kernel: str, shape: str, fn, per_call: int = 1) -> float:
        """Times fn, which makes `per_call` calls of the kernel; records the time of one."""
        us = _time(fn, device, args.repeats, args.graph_timer) / per_call
        results.append({"kernel": kernel, "shape": shape, "device": str(device), "dtype": str(dtype).split(".")[1],
                        "median_us": round(us, 1), "timer": "cuda_graph" if args.graph_timer else "host"})
        print(json.dumps(results[-1]), flush=True)
        return us

    if args.only == "moe":
        moe_kernels(record, device, dtype, args.small)
        return
    if args.only == "mxfp4":
        mxfp4_moe_kernels(record, device, dtype, args.small)
        return
    if args.only == "int4":
        int4_moe_kernels(record, device, dtype, args.small)
        return
    if args.only == "quant":
        quant_kernels(record, device, dtype, args.small)
        return
    if args.only == "mla":
        mla_kernels(record, device, dtype, args.small)
        mla_indexer_kernels(record, device, dtype, args.small)
        return
    if args.only == "long_context":
        long_context_kernels(record, device, dtype, args.small)
        return
    if args.only == "token_bitmask":
        token_bitmask_kernels(record, device, vocab)
        return
    if args.only == "linear_attention":
        linear_attention_kernels(record, device, dtype, args.small)
        return
    if args.only == "sampling":  # a decode step's batch sizes
        for rows in (1, 64, 256):
            sampling_kernels(record, device, rows // scale or 1, vocab // scale)
        return
    if args.only == "vocab_argmax":  # a greedy decode step's token (graph-timer friendly)
        for rows in (1, 64, 256):
            vocab_argmax_kernels(record, device, dtype, rows // scale or 1, vocab // scale)
        return
    if args.only == "dense":  # a decode batch's projections (CUDA)
        dense_kernels(record, device, dtype, args.small)
        return
    if args.only == "spec":
        rejection_sampling_kernels(record, device, vocab, args.small)
        return
    if args.only == "zentorch":  # CPU: zentorch's ops against ours
        zentorch_kernels(record, device)
        return
    if args.only == "block_quant":  # CPU: the packed GGUF linears
        block_quant_kernels(record, device)
        return
    attention = selector.select("attention", device)
    for name, num_seqs, q_len, seq_len in [("decode", 64 // scale, 1, 1024 // scale),
                                           ("prefill", 4 // min(scale, 4) or 1, 512 // scale, 512 // scale)]:
        q, kv, cache, md = _attention_case(device, dtype, num_seqs, q_len, seq_len, heads, kv_heads, head_dim)
        impl = attention(heads, head_dim, kv_heads, head_dim ** -0.5, None)
        record(f"attention.{attention.name}", f"{name} seqs={num_seqs} q={q_len} kv={seq_len}",
               lambda: impl.forward(q, kv, kv, cache, md))
        if device.type == "cpu":  # kv_cache_dtype="float16": half the bytes, converted as read
            cache16 = cache.to(torch.float16)
            record(f"attention.{attention.name}", f"{name} seqs={num_seqs} q={q_len} kv={seq_len} float16 cache",
                   lambda: impl.forward(q, kv, kv, cache16, md))

    # Long context at batch 1: flash decoding (KV splits) against one program per KV head.
    q, kv, cache, md = _attention_case(device, dtype, 1, 1, 32768 // scale, heads, kv_heads, head_dim)
    for splits in (1, None):
        impl = attention(heads, head_dim, kv_heads, head_dim ** -0.5, None)
        if hasattr(impl, "num_kv_splits"):
            impl.num_kv_splits = splits
        elif splits == 1:
            continue
        label = "-" if not hasattr(impl, "num_kv_splits") else "auto" if splits is None else str(splits)
        record(f"attention.{attention.name}", f"decode seqs=1 q=1 kv={32768 // scale} kv_splits={label}",
               lambda: impl.forward(q, kv, kv, cache, md))

    tokens = 256 // scale
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    weight = torch.ones(hidden, device=device, dtype=dtype)
    norm = selector.select("rms_norm", device)
    record(f"rms_norm.{norm.name}", f"tokens={tokens} hidden={hidden} +residual",
           lambda: norm.forward(x, weight, 1e-6, x))
    gate_up = torch.randn(tokens, 2 * 12288 // scale, device=device, dtype=dtype)
    for family in ("silu_and_mul", "gelu_tanh_and_mul"):  # (GELU-tanh: Gemma 3's gating)
        for act in selector.candidates(family):
            if act.unsupported_reason(device) is None:
                record(f"{family}.{act.name}", f"tokens={tokens} d={12288 // scale}",
                       lambda act=act: act.forward(gate_up))
    # QKV prologue (Qwen3: QK norm + RoPE + KV write), every implementation that runs here.
    positions = torch.arange(tokens, device=device)
    cos_sin = torch.randn(4096, head_dim, device=device)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    norm_weight = torch.ones(head_dim, device=device, dtype=dtype)
    cache = torch.zeros(2, tokens // 16 + 1, 16, kv_heads, head_dim, device=device, dtype=dtype)
    slots = torch.arange(tokens, device=device)
    for impl in selector.candidates("qkv_prologue"):
        if impl.unsupported_reason(device) is None:
            record(f"qkv_prologue.{impl.name}", f"tokens={tokens} heads={heads}/{kv_heads} d={head_dim} qk_norm",
                   lambda: impl.forward(qkv, positions, cos_sin, norm_weight, norm_weight, 1e-6, cache, slots,
                                        heads, kv_heads, head_dim))
    if device.type == "cpu":
        block_quant_kernels(record, device)
    dense_kernels(record, device, dtype, args.small)
    rows = 64 // scale
    sampling_kernels(record, device, rows, vocab)
    token_bitmask_kernels(record, device, vocab)
    rejection_sampling_kernels(record, device, vocab, args.small)
    moe_kernels(record, device, dtype, args.small)
    mla_kernels(record, device, dtype, args.small)
    mla_indexer_kernels(record, device, dtype, args.small)
    quant_kernels(record, device, dtype, args.small)


if __name__ == "__main__":
    main()
