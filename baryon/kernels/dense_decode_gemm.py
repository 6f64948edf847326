"""16-bit GEMM for decode batches of 2 to MAX_M rows on the GPU (family `dense_decode_linear`):

    y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n])     x [M, K], w [N, K] bfloat16 / float16 -> y [M, N]

Between the one-row GEMV (`dense_gemv`) and cuBLAS's GEMM (prefill): cuBLAS tiles a decode batch
with the tokens on the MMA's tall side and, on a narrow weight (a tensor-parallel rank's qkv or o
projection), launches fewer tiles than the GPU has SMs; its launches also cannot start before the
kernel ahead ends. This is the swap-AB GEMM (`swap_ab_gemm.py`) on 16-bit operands: weight rows
on the tall side, K sliced over programs where the tiles alone leave SMs idle, launched with
programmatic dependent launch. A layer takes it only where `plan` has tiles for its shape and row
count (tuned with `benchmarks/tune_decode_gemm.py`); elsewhere cuBLAS stays.

Kernels: `triton` (TritonDenseDecodeLinear) and `torch` (TorchDenseDecodeLinear, the reference: a
float32 matmul; runs anywhere).
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.dense_gemv import dense_gemv_reference
from baryon.kernels.selector import Kernel
from baryon.kernels.swap_ab_gemm import DecodeTiles, split_slices, swap_ab_linear
from baryon.kernels.triton_utils import TritonKernel, multiprocessor_count

MAX_M = 64  # the most rows a call takes
T = DecodeTiles

# (largest M, smallest N, smallest K, tiles or None for cuBLAS, K slices or 0 for `split_k`'s rule):
# first match wins. Tuned on an H200 with `python benchmarks/tune_decode_gemm.py --quick --m 16 32 64`
# (2026-11-27; Qwen3-8B's projections at TP=1 and one TP=2 rank's, us per call, CUDA-graph replays,
# the best tiles against cuBLAS): at 16 rows TP=2 qkv / o / gate-up / down 9.1 / 6.7 / 25.5 / 14.8
# against 11.1 / 7.3 / 27.2 / 17.6, TP=1 15.1 / 10.8 / 47.5 / 26.4 against 15.5 / 13.7 / 49.2 /
# 29.0; at 32 rows TP=2 9.6 / 7.1 / 27.2 / 15.6 against 11.4 / 7.4 / 29.1 / 18.0, TP=1 15.9 / 11.4
# / 49.8 / 27.5 against 16.1 / 14.2 / 51.1 / 30.1; at 64 rows TP=2 10.5 / 7.5 / 31.0 / 16.6 against
# 10.4 / 7.4 / 28.8 / 15.7, TP=1 16.9 / 12.0 / 55.0 / 28.7 against 16.2 / 12.1 / 50.2 / 32.1, so
# past 32 rows the kernel keeps only the layers where it won. Other models' shapes take the rows
# of the nearest sizes (not tuned).
TILE_TABLE: tuple[tuple[int, int, int, DecodeTiles | None, int], ...] = (
    (16, 12288, 0, T(16, 64, 128, 4, 3), 1),     # gate/up
    (16, 6144, 0, T(16, 64, 128, 4, 4), 2),      # qkv of an 8B
    (16, 4096, 12288, T(16, 64, 128, 4, 4), 4),  # down of an 8B
    (16, 4096, 6144, T(16, 64, 256, 4, 4), 1),   # down of an 8B at TP=2
    (16, 4096, 4096, T(16, 64, 128, 4, 4), 2),   # o of an 8B
    (16, 4096, 0, T(16, 64, 256, 4, 4), 1),      # o of an 8B at TP=2
    (16, 3072, 4096, T(16, 64, 128, 4, 3), 4),   # qkv of an 8B at TP=2
    (16, 0, 0, T(16, 64, 128, 4, 4), 0),
    (32, 12288, 0, T(32, 64, 128, 4, 3), 1),     # gate/up
    (32, 6144, 0, T(32, 64, 128, 4, 3), 2),      # qkv of an 8B
    (32, 4096, 12288, T(32, 64, 128, 4, 3), 4),  # down of an 8B
    (32, 4096, 6144, T(32, 64, 128, 4, 4), 2),   # down of an 8B at TP=2
    (32, 4096, 4096, T(32, 64, 128, 4, 4), 2),   # o of an 8B
    (32, 4096, 0, T(32, 64, 256, 4, 4), 1),      # o of an 8B at TP=2
    (32, 3072, 4096, T(32, 64, 128, 4, 3), 4),   # qkv of an 8B at TP=2
    (32, 0, 0, T(32, 64, 128, 4, 3), 0),
    (MAX_M, 6144, 0, None, 0),                   # gate/up, qkv of an 8B: cuBLAS
    (MAX_M, 4096, 12288, T(64, 64, 128, 4, 4), 0),  # down of an 8B
    (MAX_M, 4096, 6144, None, 0),                # down of an 8B at TP=2: cuBLAS
    (MAX_M, 4096, 4096, T(64, 64, 128, 4, 4), 0),   # o of an 8B
    (MAX_M, 3072, 0, None, 0),                   # o, qkv of an 8B at TP=2: cuBLAS
    (MAX_M, 0, 0, T(32, 64, 128, 4, 3), 0),
)
DEFAULT_TILES = T(64, 64, 128, 4, 4)  # a direct call on a shape the table leaves to cuBLAS


def plan(m: int, n: int, k: int) -> tuple[DecodeTiles | None, int]:
    """(tiles or None where cuBLAS measured as fast, K slices or 0) for m rows of an [n, k] weight."""
    return next(cfg[3:] for cfg in TILE_TABLE if m <= cfg[0] and n >= cfg[1] and k >= cfg[2])


def split_k(m: int, n: int, k: int, device: torch.device, tiles: DecodeTiles) -> int:
    """K slices for m rows: `split_slices` on the device's SMs (one wave of programs)."""
    return split_slices(m, n, k, tiles, multiprocessor_count(device, off_gpu=4))


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dense_decode_linear takes a bfloat16 / float16 weight [N, K], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, {weight.shape[1]}], got {tuple(x.shape)}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"dense_decode_linear serves at most {MAX_M} rows, got {x.shape[0]}")


class TorchDenseDecodeLinear(Kernel):
    name = "torch"
    max_m = MAX_M

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        _check(x, weight)
        return dense_gemv_reference(x, weight, bias)


class TritonDenseDecodeLinear(TritonKernel):
    family = "dense_decode_linear"
    max_m = MAX_M

    @classmethod
    def cannot_implement_reason(cls, *, dtype: torch.dtype = torch.bfloat16, **_: Any) -> str | None:
        if dtype not in (torch.bfloat16, torch.float16):
            return f"weights in {dtype} (supported: torch.bfloat16, torch.float16)"
        return None

    @staticmethod
    def serves(m: int, n: int, k: int) -> bool:
        """Whether m rows of an [n, k] weight are this kernel's (else cuBLAS's)."""
        return 1 < m <= MAX_M and plan(m, n, k)[0] is not None

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                split: int | None = None, tiles: DecodeTiles | None = None) -> torch.Tensor:
        """x [M, K] (M <= MAX_M), weight [N, K] of x's dtype -> [M, N]. split / tiles: K slices /
        tiles instead of `split_k`'s and the table's choice (tests, tuning)."""
        _check(x, weight)
        if x.dtype != weight.dtype:
            raise ValueError(f"x is {x.dtype}, the weight {weight.dtype}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        if weight.stride(-1) != 1:
            raise ValueError("dense_decode_linear needs the weight's rows contiguous")
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
        if m == 0:
            return out
        table_tiles, table_split = plan(m, n, k)
        if tiles is None:
            tiles, split = table_tiles or DEFAULT_TILES, split or table_split
        return swap_ab_linear(x, weight, out, bias, tiles, split or split_k(m, n, k, x.device, tiles))
