"""MXFP4 (OCP microscaling, as GPT-OSS publishes its experts): torch reference.

A row of K values is stored as K / 2 bytes of e2m1 codes (two per byte, the even-indexed value
in the low nibble) and K / 32 e8m0 scales (one byte each: 2^(s - 127)); value = code * scale.
An e2m1 code is a sign bit and a magnitude in {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

The Triton expert kernels (`experts_triton`, MXFP4=True) decode the same bits in registers.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per e8m0 scale
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E8M0_BIAS = 127


def e2m1_values(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """[16]: the value of each 4-bit code (bit 3 the sign)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat((magnitudes, -magnitudes))


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., K / 2] uint8 with scales [..., K / 32] uint8 -> [..., K] in dtype."""
    if blocks.shape[-1] != scales.shape[-1] * GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree: "
                         f"each scale covers {GROUP // 2} bytes ({GROUP} values)")
    table = e2m1_values(torch.float32, blocks.device)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2).long()  # [..., K]
    exponents = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(table[codes], exponents.repeat_interleave(GROUP, dim=-1).float())
    return values.to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks [..., K / 2] uint8, scales [..., K / 32] uint8):
    each group's scale is 2^(floor(log2(amax)) - 2) (the OCP rule: the largest magnitude lands in
    [4, 8)), each value the nearest code of value / scale (saturated at +-6)."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs rows of a multiple of {GROUP} values, got {w.shape[-1]}")
    groups = w.float().unflatten(-1, (-1, GROUP))  # [..., K / 32, 32]
    amax = groups.abs().amax(dim=-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2, -E8M0_BIAS)
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = (groups / torch.exp2(exponent)).clamp(-E2M1_MAX, E2M1_MAX)
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=w.device)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # nearest magnitude
    code = code + 8 * ((scaled < 0) & (code > 0))
    code = code.flatten(-2).to(torch.uint8)  # [..., K]
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + E8M0_BIAS).to(torch.uint8)
