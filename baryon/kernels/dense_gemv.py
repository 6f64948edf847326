"""GEMV of a 16-bit float weight for decode batches on the GPU (family `dense_gemv`):

    y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n])     x [M, K], w [N, K] -> y [M, N]

x in the model's dtype, w in it too (bfloat16 / float16) or in float32 (a router kept in float32,
DeepSeek's), products summed in float32, the result in x's dtype or the one asked for. At one row
a decode step's projections are bound by reading their weights; cuBLAS streams the large ones
near memory speed but not the small and medium ones, and a cuBLAS launch cannot start before the
kernel ahead of it ends. This kernel is the 8-bit GEMV's design (`quant/w8_gemv.py`) on 16-bit
weights: one program owns BLOCK_N weight rows and every row of x (at most MAX_M) over the whole
of K, streams [BLOCK_N, BLOCK_K] tiles (16-byte loads along K), keeps float32 partial sums and
reduces them once at the end. On Hopper it is launched with programmatic dependent launch: its
programs start during the previous kernel's tail and load their first weight tile before waiting
for x.

Kernels: `triton` (TritonDenseGemv) and `torch` (TorchDenseGemv, the reference: a float32 matmul;
runs anywhere).
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import TritonKernel, pdl_launch, tl, triton

if triton is not None:
    from baryon.kernels.all_reduce_rms_norm import push_pushed_row

MAX_M = 8  # the most rows the kernel takes
# The most rows a layer sends it (larger batches keep cuBLAS): on an H100 (benchmarks/tune_dense_gemv.py)
# a decode step's projections chained in one graph took 4.80 / 0.48 ms against cuBLAS's 5.35 / 0.73
# (Qwen3-8B / 0.6B) at one row, but 6.68 / 1.23 at two rows: with x's rows sharing each weight tile
# the best tiles only tie cuBLAS on the 8B's layers and lose on the 0.6B's.
DECODE_MAX_M = 1


def dense_gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[M, N] in out_dtype (default: x's): x times the weight in float32, plus the bias."""
    y = x.float() @ weight.float().t()  # [M, N] float32
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or not weight.dtype.is_floating_point or weight.element_size() > 4:
        raise ValueError(f"dense_gemv takes a float weight [N, K], got {weight.dtype} {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.shape[1]}")


class TorchDenseGemv(Kernel):
    name = "torch"
    max_m = DECODE_MAX_M

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        _check(x, weight)
        return dense_gemv_reference(x, weight, bias, out_dtype)


# (largest M, smallest N, smallest K, BLOCK_N, BLOCK_K, num_warps): first match wins. Tuned on an
# H100 with benchmarks/tune_dense_gemv.py (one row; us per layer, the GEMV against cuBLAS): Qwen3-8B
# qkv 17.5 / 20.6, o 11.6 / 16.6, gate/up 64.5 / 71.7, down 34.4 / 39.6 (2.9-3.1 TB/s); Qwen3-0.6B
# qkv 3.5 / 5.6, o 2.8 / 5.7, gate/up 4.5 / 7.0, down 3.7 / 7.9; one rank of Qwen3-8B at TP=2
# (`--models qwen3-8b-tp2`, 2026-11-26) qkv 9.6 / 13.6, o 6.4 / 8.6, gate/up 34.1 / 36.3, down
# 18.0 / 22.5 (four warps, not eight, on the o / down rows: 8.6 -> 6.4 and 21.5 -> 18.0). Narrow
# layers take few rows per program so that enough programs stream at once.
TILE_TABLE: tuple[tuple[int, int, int, int, int, int], ...] = (
    (1, 12288, 0, 8, 1024, 4),    # gate/up of an 8B
    (1, 8192, 4096, 8, 1024, 8),  # (as the qkv row below: what such layers took before the next row)
    (1, 8192, 3584, 4, 256, 4),   # qkv of Gemma-2-9B (8192 x 3584, H200: 20.0 -> 16.4 us; cuBLAS 16.4)
    (1, 6144, 2048, 8, 1024, 8),  # qkv of an 8B
    (1, 6144, 0, 16, 512, 8),     # gate/up of a 0.6B
    (1, 4096, 8192, 8, 1024, 4),  # down of an 8B
    (1, 4096, 4096, 16, 1024, 4),  # o of an 8B; down of an 8B at TP=2 (K 6144)
    (1, 4096, 2048, 8, 1024, 4),  # o of an 8B at TP=2 (K 2048)
    (1, 2048, 0, 4, 1024, 4),     # qkv of a 0.6B
    (1, 0, 0, 2, 1024, 8),        # o and down of a 0.6B
    (MAX_M, 0, 0, 8, 128, 4),
)


def tile_config(m: int, n: int, k: int, override: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for m rows of an [n, k] weight."""
    return override or next(cfg[3:] for cfg in TILE_TABLE if m <= cfg[0] and n >= cfg[1] and k >= cfg[2])


if triton is not None:

    @triton.jit
    def _tile(w_ptrs, n_mask, cols, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
        """The [BN, BK] weight tile at w_ptrs; cols [BK] its columns."""
        if EVEN_N and EVEN_K:
            return tl.load(w_ptrs)
        if EVEN_K:
            return tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        return tl.load(w_ptrs, mask=n_mask[:, None] & (cols < K)[None, :], other=0.0)

    @triton.jit
    def _x_rows(x_ptrs, row_mask, cols, K, EVEN_K: tl.constexpr):
        """x's [ROWS, BK] tile in float32 (rows past M read as 0)."""
        if EVEN_K:
            return tl.load(x_ptrs, mask=row_mask[:, None], other=0.0).to(tl.float32)
        return tl.load(x_ptrs, mask=row_mask[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _dense_gemv_kernel(x, w, bias, out, M, N, K, stride_xm, stride_wn, stride_om,
                           HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                           PUSH: tl.constexpr, buffers, counters, RANK: tl.constexpr, WORLD: tl.constexpr,
                           SLOT_ROWS: tl.constexpr, ROW_STRIDE: tl.constexpr, ROW: tl.constexpr,
                           SENTINEL: tl.constexpr, BITS: tl.constexpr):
        """out[m, n] for BLOCK_N rows n of the weight and ROWS rows m of x (program (n tile, row
        group)): each weight tile is loaded once for the ROWS rows of x. PUSH (one row): the
        block also goes to every peer's all-reduce buffer (`push_pushed_row`, the rest of the
        arguments are its)."""
        pid = tl.program_id(0)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # [R]
        row_mask = rows < M
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        cols = tl.arange(0, BLOCK_K)  # [BK]
        n_mask = offs_n < N
        w_ptrs = w + offs_n[:, None].to(tl.int64) * stride_wn + cols[None, :]  # [BN, BK]
        x_ptrs = x + rows[:, None] * stride_xm + cols[None, :]  # [R, BK]
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        wt = _tile(w_ptrs, n_mask, cols, K, EVEN_N, EVEN_K)
        if PDL:  # the weight never depends on an earlier kernel; x does
            tl.extra.cuda.gdc_wait()
        xt = _x_rows(x_ptrs, row_mask, cols, K, EVEN_K)
        acc = wt.to(tl.float32)[None, :, :] * xt[:, None, :]  # [R, BN, BK]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            wt = _tile(w_ptrs, n_mask, k0 + cols, K, EVEN_N, EVEN_K)
            xt = _x_rows(x_ptrs, row_mask, k0 + cols, K, EVEN_K)
            acc += wt.to(tl.float32)[None, :, :] * xt[:, None, :]
        y = tl.sum(acc, axis=2)  # [R, BN]
        if HAS_BIAS:
            y = y + tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = y.to(out.dtype.element_ty)
        tl.store(out + rows[:, None] * stride_om + offs_n[None, :], y, mask=row_mask[:, None] & n_mask[None, :])
        if PUSH:  # ROWS == 1
            push_pushed_row(tl.reshape(y, (BLOCK_N,)), offs_n, n_mask, buffers, counters, RANK, WORLD, SLOT_ROWS,
                            ROW_STRIDE, ROW, SENTINEL, BITS)


class TritonDenseGemv(TritonKernel):
    family = "dense_gemv"
    max_m = DECODE_MAX_M

    @classmethod
    def cannot_implement_reason(cls, *, dtype: torch.dtype = torch.bfloat16, **_: Any) -> str | None:
        allowed = (torch.bfloat16, torch.float16, torch.float32)
        if dtype not in allowed:
            return f"weights in {dtype} (supported: {', '.join(map(str, allowed))})"
        return None

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, tiles: tuple[int, int, int] | None = None,
                push: dict | None = None) -> torch.Tensor:
        """x [M, K] with M <= MAX_M -> [M, N] in out_dtype (default: x's). tiles: (BLOCK_N,
        BLOCK_K, num_warps) instead of the table's (tests, tuning). push: one row's output also
        into the peers' all-reduce buffers (`SymmMemPushedAllReduce.push_arguments()`)."""
        _check(x, weight)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if weight.stride(-1) != 1:
            raise ValueError("dense_gemv needs the weight's rows contiguous")
        m, k = x.shape
        n = weight.shape[0]
        if m > MAX_M:
            raise ValueError(f"dense_gemv serves at most {MAX_M} rows, got {m}")
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
        if m == 0:
            return out
        if push is not None and m != 1:
            raise ValueError(f"dense_gemv pushes one row to the peers, got {m}")
        push_args = push or dict(buffers=out, counters=out, RANK=0, WORLD=1, SLOT_ROWS=1, ROW_STRIDE=1, ROW=0,
                                 SENTINEL=0, BITS=16)  # unused
        block_n, block_k, warps = tile_config(m, n, k, tiles)
        rows = triton.next_power_of_2(m)  # every row of x in one program: each weight tile read once
        _dense_gemv_kernel[(triton.cdiv(n, block_n), 1)](
            x, weight, bias if bias is not None else out, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0, ROWS=rows,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, PUSH=push is not None, **push_args,
            **pdl_launch(x.device))
        return out
