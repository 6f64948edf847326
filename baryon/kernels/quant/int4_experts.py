"""Packed int4 experts (GPTQ, AWQ and compressed-tensors W4A16 MoE checkpoints): the layout the
Triton expert kernels read (`experts_triton`, FOUR_BIT=2) and its torch reference.

Each checkpoint's experts are first read into the canonical form of `quantization/wna16.py`
(codes 0..15, a scale and a zero code per group of G values along K); they are then stored as

    blocks uint8 [..., K / 2]       two codes a byte, the even-indexed value in the low nibble
    pairs  dtype [..., K / 32, 2]   (scale, zero) of each 32 values: a group of G (a multiple of
                                    32) repeated G / 32 times
    value = (code - zero) * scale   in float32

the byte layout of MXFP4 (`quant/mxfp4.py`), so the kernels share their loads and tiles; the
(scale, zero) pair per 32 values costs one bit a value in a 16-bit dtype (five bits a value in
all, against sixteen for the dequantized experts). Zeros are small integers, exact in any float.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per stored (scale, zero) pair


def pack_int4_experts(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [..., K] (0..15), scales [..., G] and zeros [..., G] (codes of the zero) of
    groups of K / G values -> (blocks uint8 [..., K / 2], pairs dtype [..., K / 32, 2])."""
    k, groups = codes.shape[-1], scales.shape[-1]
    if k % groups or (k // groups) % GROUP:
        raise ValueError(f"int4 experts need groups of a multiple of {GROUP} values; {k} values in {groups} groups")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("int4 codes must lie in 0..15")
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [..., K / 2]
    repeat = k // groups // GROUP
    pairs = torch.stack((scales.to(dtype).repeat_interleave(repeat, dim=-1),
                         zeros.to(dtype).repeat_interleave(repeat, dim=-1)), dim=-1)  # [..., K / 32, 2]
    return blocks, pairs.contiguous()


def dequantize_int4_experts(blocks: torch.Tensor, pairs: torch.Tensor,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., K / 2] uint8 with pairs [..., K / 32, 2] -> [..., K] in dtype."""
    if blocks.shape[-1] * 2 != pairs.shape[-2] * GROUP or pairs.shape[-1] != 2:
        raise ValueError(f"int4 blocks {tuple(blocks.shape)} and (scale, zero) pairs {tuple(pairs.shape)} "
                         f"disagree: each pair covers {GROUP // 2} bytes ({GROUP} values)")
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2).float()  # [..., K]
    scale = pairs[..., 0].float().repeat_interleave(GROUP, dim=-1)
    zero = pairs[..., 1].float().repeat_interleave(GROUP, dim=-1)
    return ((codes - zero) * scale).to(dtype)
