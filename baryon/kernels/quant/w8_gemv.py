"""Weight-only GEMV of 8-bit weights for decode batches (family `w8_gemv`):

    y[m, n] = sum_k x[m, k] * w_q[n, k] * s(n, k)  (+ bias[n])     x [M, K], w_q [N, K] -> y [M, N]

x as the layer receives it (bfloat16 / float16; float32 in the interpreter), not quantized;
w_q float8_e4m3fn or int8, [N, K] row-major (the layout every FP8 and INT8 kernel keeps); the
float32 weight scale either

    rowwise  scale [N]                          s(n, k) = scale[n]
    block    scale [ceil(N / bn), ceil(K / bk)] s(n, k) = scale[n // bn, k // bk]

At a decode batch of one row (DECODE_MAX_M) an FP8 or INT8 layer is bound by reading its weight, and quantizing
the activations costs a kernel launch and buys nothing: this kernel reads the 8-bit weight once,
converts it in registers and multiplies the activations as they are, in float32. One program
owns BLOCK_N weight rows and one row of x over the whole of K (no split, so no second pass): it
streams [BLOCK_N, BLOCK_K] tiles (16-byte loads along K), keeps [BLOCK_N, BLOCK_K] float32 partial
sums and reduces them once at the end, where rowwise scales, the bias and the cast are applied. Block
scales multiply the weight as it is converted: a step is held as [NB, SB] sub-blocks of SB =
min(BLOCK_K, bk) columns, one scale each. Many small programs per SM keep enough loads in flight
to stream the weight at memory speed. On Hopper the kernel is launched with programmatic
dependent launch (`triton_utils.pdl_enabled`): its programs start during the previous kernel's
tail and load their first weight tile before waiting for x (measured on an H100 over Qwen3-8B's
36 x 4 projections chained in a CUDA graph, `benchmarks/fp8_decode.py`: 3.15 ms before this
kernel's rewrite, 2.54 ms with it).

Kernels: `triton` (TritonW8Gemv) and `torch` (TorchW8Gemv, the reference: dequantize, float32
matmul; runs anywhere).
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.quant.act_quant import FP8, fp8_to_float
from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import INTERPRETED, TritonKernel, pdl_launch, tl, triton

MAX_M = 4  # the most rows the kernel takes
# The most rows a layer sends it: on an H100 (benchmarks/tune_quant_gemv.py) the GEMV streams an FP8
# weight at 1.8-2.4 TB/s for one row, ahead of cuBLAS's FP8 GEMM; at four rows it falls to about
# 1 TB/s, behind the GEMM, so larger batches quantize their activations and take the GEMM.
DECODE_MAX_M = 1
WEIGHT_DTYPES = (FP8, torch.int8)


def _dequantize(w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [N, K]."""
    w = fp8_to_float(w_q) if w_q.dtype == FP8 else w_q.float()
    if block is None:
        return w * scale.float().reshape(-1, 1)
    bn, bk = block
    n, k = w_q.shape
    return w * scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def w8_gemv_reference(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int] | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] in x's dtype: x in float32 times the float32 dequantized weight, plus the bias."""
    y = x.float() @ _dequantize(w_q, scale, block).t()  # [M, N] float32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _check(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    if w_q.dtype not in WEIGHT_DTYPES or w_q.dim() != 2:
        raise ValueError(f"w8_gemv takes an fp8 or int8 weight [N, K], got {w_q.dtype} {tuple(w_q.shape)}")
    n, k = w_q.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    expected = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"w8_gemv scale must be {expected} for a [{n}, {k}] weight (block {block}), "
                         f"got {tuple(scale.shape)}")


class TorchW8Gemv(Kernel):
    name = "torch"
    max_m = DECODE_MAX_M

    @staticmethod
    def forward(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        _check(x, w_q, scale, block)
        return w8_gemv_reference(x, w_q, scale, block, bias)


# (largest M, smallest N, BLOCK_N, BLOCK_K, num_warps): first match wins. Tuned on an H100 with
# benchmarks/tune_quant_gemv.py over Qwen3-8B's projections: one row takes 16 rows of the weight
# per program and 512 columns per step (8 warps) on wide layers (qkv, gate/up), 8 x 1024 (4 warps)
# on the 4096-wide ones: 2.4-2.9 TB/s (retuned after the rewrite for PDL, 2026-11-24).
TILE_TABLE: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 6144, 16, 512, 8),
    (1, 0, 8, 1024, 4),
    (MAX_M, 0, 8, 256, 4),
)


def tile_config(m: int, n: int, override: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for m rows of an n-row weight: K steps of BLOCK_K columns
    (with block scales, split into sub-blocks of min(BLOCK_K, bk) columns, one scale each)."""
    return override or next(cfg[2:] for cfg in TILE_TABLE if m <= cfg[0] and n >= cfg[1])


if triton is not None:

    @triton.jit
    def _weight_tile(w_ptrs, n_mask, cols, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
        """The [BN, NB, SB] weight tile at w_ptrs; cols [NB, SB] its columns."""
        if EVEN_N and EVEN_K:
            return tl.load(w_ptrs)
        if EVEN_K:
            return tl.load(w_ptrs, mask=n_mask[:, None, None], other=0.0)
        return tl.load(w_ptrs, mask=n_mask[:, None, None] & (cols < K)[None, :, :], other=0.0)

    @triton.jit
    def _accumulate(acc, wt, x_ptrs, scale, offs_n, n_mask, cols, K, stride_sn, bn, bk,
                    BLOCK_SCALES: tl.constexpr, EVEN_K: tl.constexpr, SB: tl.constexpr):
        """acc [BN, NB, SB] + x's columns cols times the tile wt (times its block scales)."""
        if EVEN_K:
            xt = tl.load(x_ptrs)  # [NB, SB]
        else:
            xt = tl.load(x_ptrs, mask=cols < K, other=0.0)
        wf = wt.to(tl.float32)  # [BN, NB, SB]
        if BLOCK_SCALES:
            first = tl.min(cols, axis=1)  # [NB]: each sub-block's first column
            s_ptrs = scale + (offs_n // bn)[:, None] * stride_sn + (first // bk)[None, :]
            s = tl.load(s_ptrs, mask=n_mask[:, None] & (first < K)[None, :], other=0.0)  # [BN, NB]
            wf = wf * s[:, :, None]
        return acc + xt.to(tl.float32)[None, :, :] * wf

    @triton.jit
    def _w8_gemv_kernel(x, w, scale, bias, out, N, K, stride_xm, stride_om, stride_sn, bn, bk,
                        BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
                        EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SB: tl.constexpr,
                        PDL: tl.constexpr):
        """out[m, n] for BLOCK_N rows n of the weight and one row m of x (program (n tile, m)).
        K steps of NB x SB columns, held as [BLOCK_N, NB, SB] so that each of the NB sub-blocks of
        SB columns (SB divides bk) takes one block scale; rowwise scales are applied once at the
        end. With PDL the first weight tile is loaded before waiting for the kernel that wrote x."""
        pid = tl.program_id(0)
        row = tl.program_id(1)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        cols = tl.arange(0, NB)[:, None] * SB + tl.arange(0, SB)[None, :]  # [NB, SB]: column within the step
        n_mask = offs_n < N
        w_ptrs = w + offs_n[:, None, None].to(tl.int64) * K + cols[None, :, :]  # [BN, NB, SB]
        x_ptrs = x + row * stride_xm + cols  # [NB, SB]
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        wt = _weight_tile(w_ptrs, n_mask, cols, K, EVEN_N, EVEN_K)
        if PDL:  # the weight never depends on an earlier kernel; x does
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros([BLOCK_N, NB, SB], dtype=tl.float32)
        acc = _accumulate(acc, wt, x_ptrs, scale, offs_n, n_mask, cols, K, stride_sn, bn, bk, BLOCK_SCALES,
                          EVEN_K, SB)
        for k0 in range(NB * SB, K, NB * SB):
            w_ptrs += NB * SB
            x_ptrs += NB * SB
            wt = _weight_tile(w_ptrs, n_mask, k0 + cols, K, EVEN_N, EVEN_K)
            acc = _accumulate(acc, wt, x_ptrs, scale, offs_n, n_mask, k0 + cols, K, stride_sn, bn, bk,
                              BLOCK_SCALES, EVEN_K, SB)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
        if not BLOCK_SCALES:
            y = y * tl.load(scale + offs_n, mask=n_mask, other=0.0)
        if HAS_BIAS:
            y = y + tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out + row * stride_om + offs_n, y.to(out.dtype.element_ty), mask=n_mask)


class TritonW8Gemv(TritonKernel):
    family = "w8_gemv"
    max_m = DECODE_MAX_M

    @classmethod
    def cannot_implement_reason(cls, *, block: tuple[int, int] | None = None, dtype: torch.dtype = torch.bfloat16,
                                **_: Any) -> str | None:
        allowed = (torch.bfloat16, torch.float16) + ((torch.float32,) if INTERPRETED else ())
        if dtype not in allowed:
            return f"activations in {dtype} (supported: {', '.join(map(str, allowed))})"
        if block is not None and (block[1] < 16 or block[1] & (block[1] - 1)):
            return f"block scales with bk={block[1]} (a power of two >= 16 is needed to tile K)"
        return None

    @staticmethod
    def forward(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                bias: torch.Tensor | None = None, tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
        """x [M, K] with M <= MAX_M -> [M, N] in x's dtype. tiles: (BLOCK_N, BLOCK_K, num_warps)
        instead of the table's (tests, tuning)."""
        _check(x, w_q, scale, block)
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        n = w_q.shape[0]
        if m > MAX_M:
            raise ValueError(f"w8_gemv serves at most {MAX_M} rows, got {m}")
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0:
            return out
        block_n, block_k, warps = tile_config(m, n, tiles)
        bn, bk = block or (1, block_k)
        sub = min(block_k, bk)  # columns per scale within a step
        _w8_gemv_kernel[(triton.cdiv(n, block_n), m)](
            x, w_q, scale, bias if bias is not None else out, out, n, k, x.stride(0), out.stride(0),
            scale.stride(0) if block is not None else 0, bn, bk,
            BLOCK_SCALES=block is not None, HAS_BIAS=bias is not None, EVEN_N=n % block_n == 0,
            EVEN_K=k % block_k == 0, BLOCK_N=block_n, NB=block_k // sub, SB=sub, num_warps=warps,
            **pdl_launch(x.device))
        return out
