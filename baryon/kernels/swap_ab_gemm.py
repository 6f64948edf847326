"""The swap-AB GEMM of decode batches, shared by the FP8 (`quant/fp8_decode_gemm.py`) and the 16-bit
(`dense_decode_gemm.py`) decode linears:

    out^T[n, m] = sum_k w[n, k] x[m, k]      x [M, K], w [N, K] (both K-major) -> out [M, N]

A decode batch is a weight stream: a few tokens against the whole weight. General GEMMs put the
tokens on the MMA's tall side and waste most of it; here BLOCK_N weight rows are the left operand
(a warpgroup MMA's 64 rows, or 128 on two), the tokens padded to BLOCK_M the right one. Each
program owns a token tile and BLOCK_N weight rows over the whole of K, or over a slice of K when
the tiles alone leave SMs idle: the float32 partial sums then go to a buffer that a second kernel
adds in a fixed order (`split_k.reduce_split_k`, deterministic). FP8 operands promote their partial
sums to float32 every K tile and carry rowwise scales (`SCALED`); 16-bit ones accumulate in float32
as they are. Launched with programmatic dependent launch: the next kernel may start at once, and
the programs wait for the one that wrote x before their loop.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from baryon.kernels.quant.split_k import reduce_split_k, store_transposed_tile
from baryon.kernels.triton_utils import next_power_of_2, pdl_launch, tl, triton

MIN_SPLIT_TILES = 4  # K tiles a slice keeps at least when K is split


class DecodeTiles(NamedTuple):
    """One launch: BLOCK_M tokens x BLOCK_N weight rows per program, BLOCK_K columns per
    pipelined step, num_warps, num_stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def split_slices(m: int, n: int, k: int, tiles: DecodeTiles, sms: int) -> int:
    """K slices per (token tile, weight tile): doubled while the tiles times the slices still fit
    one wave on `sms` SMs and each slice keeps MIN_SPLIT_TILES tiles of K."""
    count = -(-n // tiles.block_n) * -(-m // token_tile(m, tiles))
    blocks = -(-k // tiles.block_k)
    split = 1
    while count * split * 2 <= sms and blocks // (split * 2) >= MIN_SPLIT_TILES:
        split *= 2
    return split


def token_tile(m: int, tiles: DecodeTiles) -> int:
    """The token tile a launch uses: the table's, or a smaller batch padded to a power of two (at
    least 16, the MMA's narrowest)."""
    return min(tiles.block_m, max(16, next_power_of_2(m)))


if triton is not None:

    @triton.jit
    def _swap_ab_kernel(x, w, xs, ws, bias, out, partial, M, N, K, blocks_per_split, stride_xm, stride_wn,
                        stride_xsm, stride_om, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                        SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
        """out[m tile, n tile] for BLOCK_M tokens and BLOCK_N weight rows over the K tiles
        [pid_k * blocks_per_split, ...): acc [BN, BM] = w [BN, BK] @ x^T [BK, BM]. Program
        (token tile, weight tile, K slice): the token tiles of one weight tile are neighbours in
        launch order, so they read it from L2 together. SPLIT: the unscaled float32 sums go to
        partial[pid_k] instead (`split_k.reduce_split_k` finishes)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        pid_m = tl.program_id(0)
        pid = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        rows_n = offs_n % N  # wrapped: the loop loads without row masks
        rows_m = offs_m % M
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * blocks_per_split * BLOCK_K
        w_ptrs = w + rows_n[:, None].to(tl.int64) * stride_wn + k_start + offs_k[None, :]  # [BN, BK]
        x_ptrs = x + rows_m[None, :].to(tl.int64) * stride_xm + k_start + offs_k[:, None]  # [BK, BM]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
        k_tiles = tl.minimum(blocks_per_split, tl.cdiv(K - k_start, BLOCK_K))
        for kt in range(0, k_tiles):
            if EVEN_K:
                a = tl.load(w_ptrs)
                b = tl.load(x_ptrs)
            else:
                k_left = K - k_start - kt * BLOCK_K
                a = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b = tl.load(x_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            # FP8: promote the partial sums to float32 every tile (Hopper's tensor cores otherwise
            # accumulate the whole K in reduced precision); no effect on 16-bit operands.
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if SCALED and not SPLIT:  # the scales here; a split's second pass applies them to the sum
            acc = acc * tl.load(ws + rows_n)[:, None] * tl.load(xs + rows_m * stride_xsm)[None, :]
        store_transposed_tile(acc, out, partial, bias, offs_n, offs_m, N, M, stride_om, pid_k, SPLIT, HAS_BIAS)


def swap_ab_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                   tiles: DecodeTiles, split: int, x_scale: torch.Tensor | None = None,
                   w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M >= 1), w [N, K] (each with unit stride along K) -> out [M, N] (written,
    returned), over `split` slices of K (fewer where the last ones would be empty). x_scale [M] or [1] and w_scale [N]
    float32 (FP8) come together or not at all."""
    m, k = x.shape
    n = w.shape[0]
    scaled = x_scale is not None
    block_m = token_tile(m, tiles)
    blocks = triton.cdiv(k, tiles.block_k)
    per_split = triton.cdiv(blocks, split)
    split = triton.cdiv(blocks, per_split)  # no empty slices
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out  # [S, M, N]
    stride_xsm = x_scale.stride(0) if scaled and x_scale.numel() > 1 else 0
    _swap_ab_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, tiles.block_n), split)](
        x, w, x_scale if scaled else out, w_scale if scaled else out, bias if bias is not None else out, out,
        partial, m, n, k, per_split, x.stride(0), w.stride(0), stride_xsm, out.stride(0), SCALED=scaled, HAS_BIAS=bias is not None,
        EVEN_K=k % tiles.block_k == 0, SPLIT=split > 1, BLOCK_N=tiles.block_n, BLOCK_M=block_m,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(x.device))
    if split > 1:
        row_scale = (x_scale.expand(m) if x_scale.numel() == 1 else x_scale) if scaled else None
        reduce_split_k(partial, out, bias, row_scale, w_scale)
    return out
