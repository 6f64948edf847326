"""FP8 GEMM for decode batches (family `fp8_decode_linear`): rowwise scales, 2 to 128 tokens.

    y[m, n] = x_scale[m] * w_scale[n] * sum_k x_q[m, k] * w_q[n, k]  (+ bias[n])
    x_q [M, K], w_q [N, K] float8_e4m3fn (row-major, the layout every FP8 kernel keeps),
    x_scale [M, 1] (per token, or a static scale expanded), w_scale [N] float32 -> y [M, N]

The swap-AB GEMM (`kernels/swap_ab_gemm.py`) on FP8 operands: weight rows on the MMA's tall side,
the tokens padded to 16, 32 or 64 on the other, K sliced over programs when the tiles alone leave
SMs idle (`split_k`); the FP8 partial sums are promoted to float32 every K tile; the scales, the
bias and the cast come in the epilogue (or in the split's second pass).

Measured on an H100 (`python benchmarks/fp8_decode.py`, Qwen3-8B's projections, CUDA-graph
replays over L2-overflowing weight copies): qkv / o / gate-up / down at 16 tokens 11.8 / 8.9 /
38.2 / 20.9 us (cuBLAS 17.9 / 14.5 / 47.1 / 38.7, `fp8_gemm`'s Triton 14.6 / 12.3 / 38.9 / 31.6),
at 64 tokens 12.9 / 10.8 / 42.1 / 25.2 (cuBLAS 15.3 / 14.0 / 46.0 / 33.0), with the tiles tuned
since 12.3 / 8.9 / 39.1 / 21.8; at 128 tokens 14.2 / 10.4 / 42.5 / 25.6 (cuBLAS 15.2 / 13.6 / 46.0 /
31.7); at 256 cuBLAS is ahead (MAX_M). A single token takes
the weight-only GEMV (`w8_gemv`), which needs no activation quantization.

Kernels: `triton` (TritonFp8DecodeLinear) and the reference `torch` (TorchFp8DecodeLinear, the
float32 product of the dequantized operands).
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.quant.act_quant import FP8
from baryon.kernels.quant.fp8_gemm import fp8_linear_reference
from baryon.kernels.selector import Kernel
from baryon.kernels.swap_ab_gemm import DecodeTiles, split_slices, swap_ab_linear
from baryon.kernels.triton_utils import TritonKernel, multiprocessor_count

MAX_M = 128  # the most tokens a call takes (cuBLAS's GEMM is as fast or faster past it)


# (largest M, smallest N, smallest K, DecodeTiles): first match wins. Tuned on an H100 with
# `python benchmarks/fp8_decode.py --sweep --m 32 64 128 256` (Qwen3-8B's projections, us per call,
# the best tiles against cuBLAS): at 64 tokens qkv 12.3 / 14.8, o 8.9 / 13.3 and down 21.8 / 31.5
# (two token tiles of 32), gate/up 39.1 / 44.5 (128-wide K steps); at 128 tokens qkv 14.2 / 15.2,
# o 10.4 / 13.6, gate/up 42.5 / 46.0, down 25.6 / 31.7 (split in two); at 256 tokens the best tiles
# lost on every layer but o (13.9 / 13.75), hence MAX_M.
TILE_TABLE: tuple[tuple[int, int, int, DecodeTiles], ...] = (
    (16, 0, 0, DecodeTiles(16, 64, 256, 4, 6)),
    (32, 12288, 0, DecodeTiles(32, 64, 256, 4, 3)),  # gate/up
    (32, 0, 0, DecodeTiles(32, 64, 256, 4, 6)),
    (64, 12288, 0, DecodeTiles(64, 64, 128, 4, 4)),  # gate/up
    (64, 6144, 0, DecodeTiles(64, 64, 256, 4, 4)),  # qkv
    (64, 0, 0, DecodeTiles(32, 64, 256, 4, 6)),  # o, down: two token tiles
    (MAX_M, 12288, 0, DecodeTiles(128, 64, 128, 4, 3)),  # gate/up
    (MAX_M, 0, 8192, DecodeTiles(64, 128, 256, 8, 4)),  # down
    (MAX_M, 6144, 0, DecodeTiles(64, 128, 256, 8, 4)),  # qkv
    (MAX_M, 0, 0, DecodeTiles(64, 64, 256, 4, 4)),  # o
)


def tile_config(m: int, n: int, k: int) -> DecodeTiles:
    return next(cfg[3] for cfg in TILE_TABLE if m <= cfg[0] and n >= cfg[1] and k >= cfg[2])


def _check(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> None:
    if x_q.dtype != FP8 or w_q.dtype != FP8:
        raise ValueError(f"fp8_decode_linear takes float8_e4m3fn operands, got {x_q.dtype} and {w_q.dtype}")
    m, k = x_q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k:
        raise ValueError(f"x has {k} features, the weight {w_q.shape[1]}")
    if m > MAX_M:
        raise ValueError(f"fp8_decode_linear serves at most {MAX_M} tokens, got {m}")
    if w_scale.numel() != n or x_scale.numel() not in (1, m):
        raise ValueError(f"fp8_decode_linear takes rowwise scales: w_scale [{n}] and x_scale [{m}, 1], got "
                         f"{tuple(w_scale.shape)} and {tuple(x_scale.shape)}")


class TorchFp8DecodeLinear(Kernel):
    name = "torch"
    max_m = MAX_M

    @staticmethod
    def forward(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
        _check(x_q, x_scale, w_q, w_scale)
        return fp8_linear_reference(x_q, x_scale.float().reshape(-1, 1).expand(x_q.shape[0], 1), w_q,
                                    w_scale.reshape(-1), out_dtype, bias, None)


def split_k(m: int, n: int, k: int, device: torch.device, tiles: DecodeTiles | None = None) -> int:
    """K slices per (token tile, weight tile) for m tokens: doubled while the tiles times the slices
    still fit one wave on the device's SMs and each slice keeps a few tiles of K (`split_slices`), for more
    than 32 tokens only (the smaller token tiles measured slower split). On an H100 (Qwen3-8B, 64
    tokens; `benchmarks/fp8_decode.py --splits`, 2026-11-24) o and down (64 tiles) take 2: 10.2 ->
    9.6 and 24.9 -> 22.4 us; qkv (96 tiles) and gate/up lose with any split."""
    if m <= 32:
        return 1
    return split_slices(m, n, k, tiles or tile_config(m, n, k), multiprocessor_count(device, off_gpu=4))


class TritonFp8DecodeLinear(TritonKernel):
    family = "fp8_decode_linear"
    max_m = MAX_M

    @classmethod
    def cannot_implement_reason(cls, *, block: tuple[int, int] | None = None, **_: Any) -> str | None:
        if block is not None:
            return f"block scales {tuple(block)} (the decode GEMM takes rowwise scales; block layers keep fp8_linear)"
        return None

    @staticmethod
    def forward(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype, bias: torch.Tensor | None = None, split: int | None = None,
                tiles: DecodeTiles | None = None) -> torch.Tensor:
        """x_q [M, K] fp8 (M <= MAX_M), x_scale [M, 1] or [1, 1] float32, w_q [N, K] fp8, w_scale [N]
        float32 -> [M, N] out_dtype. split / tiles: K slices / tiles instead of `split_k`'s and
        the table's choice (tests, tuning)."""
        _check(x_q, x_scale, w_q, w_scale)
        if x_q.stride(-1) != 1:
            x_q = x_q.contiguous()
        m, k = x_q.shape
        n = w_q.shape[0]
        out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)  # [M, N]
        if m == 0:
            return out
        x_scale = x_scale.float().reshape(-1)  # [M] or [1]; an expanded static scale may keep stride 0
        cfg = tiles or tile_config(m, n, k)
        return swap_ab_linear(x_q, w_q, out, bias, cfg, split or split_k(m, n, k, x_q.device, cfg), x_scale, w_scale)
