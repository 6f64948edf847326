"""Rounding float weights to FP8 (e4m3): per output channel and in blocks. Online FP8 and FP8
dummy weights use these; checkpoints arrive already rounded."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baryon.kernels.quant.act_quant import FP8, FP8_MAX


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q fp8 [N, K], scale f32 [N]) with scale = row amax / 448."""
    w32 = weight.float()
    scale = w32.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """[..., ceil(rows/bn), ceil(cols/bk)] -> [..., rows, cols] (each block's scale on its elements)."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :rows, :cols]


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] float -> (q fp8 [..., N, K], scale f32 [..., ceil(N/bn), ceil(K/bk)])."""
    bn, bk = block
    *lead, n, k = weight.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = F.pad(weight.float(), (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(*lead, rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX  # [..., rows, cols]
    q = (weight.float() / expand_block_scale(scale, n, k, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale
