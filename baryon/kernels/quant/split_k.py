"""The second pass of a GEMM whose K was split over programs: the float32 partial sums
partial [S, M, N] added in order of s (deterministic: the same bits for the same inputs), then
optionally times a per-row scale [M] and a per-column scale [N] (rowwise FP8), plus the bias,
cast to the output's dtype. One kernel launch; with PDL it waits for the GEMM at its first
statement. Used by the W4A16 GEMMs and the FP8 decode GEMM, whose first passes store their
tiles with `store_transposed_tile`."""

from __future__ import annotations

import torch

from baryon.kernels.triton_utils import pdl_launch, tl, triton, wait_and_release

BLOCK = 1024  # outputs per program

if triton is not None:

    @triton.jit
    def _split_k_reduce_kernel(partial, row_scale, col_scale, bias, out, M, N, stride_rs, stride_om,
                               SPLIT_K: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
                               BLOCK: tl.constexpr, PDL: tl.constexpr):
        """out[m, n] = (sum over s in order of partial[s, m, n]) (* row_scale[m] * col_scale[n])
        (+ bias[n]), in out's dtype."""
        wait_and_release(PDL)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mn = M * N
        mask = offs < mn
        acc = tl.load(partial + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(partial + s * mn + offs, mask=mask, other=0.0)
        m = offs // N
        n = offs % N
        if HAS_SCALES:
            acc = acc * tl.load(col_scale + n, mask=mask, other=0.0) * tl.load(row_scale + m * stride_rs, mask=mask,
                                                                                 other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias + n, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + m * stride_om + n, acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def store_transposed_tile(acc, out, partial, bias, offs_n, offs_m, N, M, stride_om, pid_k,
                              SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
        """The first pass's store of a float32 tile acc [BN, BM] of out^T (weight rows offs_n,
        tokens offs_m): with SPLIT, K slice pid_k's partial sums at partial[pid_k, m, n] for the
        second pass; else out[m, n] (+ bias[n]) in out's dtype."""
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        if SPLIT:
            tl.store(partial + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
            tl.store(out + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None],
                     acc.to(out.dtype.element_ty), mask=mask)


def reduce_split_k(partial: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
                   row_scale: torch.Tensor | None = None, col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """partial float32 [S, M, N] -> out [M, N] (written, returned). row_scale [M] (stride 0: one
    value for every row) and col_scale [N] float32 come together or not at all."""
    splits, m, n = partial.shape
    scales = row_scale is not None
    if scales != (col_scale is not None):
        raise ValueError("reduce_split_k takes a row scale and a column scale together")
    _split_k_reduce_kernel[(triton.cdiv(m * n, BLOCK),)](
        partial, row_scale if scales else partial, col_scale if scales else partial, bias if bias is not None else out,
        out, m, n, row_scale.stride(0) if scales else 0, out.stride(0), SPLIT_K=splits, HAS_SCALES=scales,
        HAS_BIAS=bias is not None, BLOCK=BLOCK, **pdl_launch(out.device))
    return out
