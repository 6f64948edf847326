"""W8A8 and W4A16 linear layers on CPU through the packed GGUF kernels (families `int8_linear` and
`w4a16_linear`, name `cpu`).

Both formats are 32-weight blocks of integer codes with one scale and one offset, which is what
`kernels/block_quant.py` multiplies (`block_quant_linear`: integer dot products by default, the
exact float32 kernel one selector choice away). So a layer is repacked once at load:

    W8A8   weight = w_scale[n] * q              codes q (int8), every block of row n: scale
                                                w_scale[n], offset 0
    W4A16  weight = s * (q - z) per group       4-bit, z = 8 (symmetric): codes q, offset -8 * s
                                                4-bit, other z: 8-bit codes q - z, offset 0
                                                8-bit: codes q - 128 (int8), offset s * (128 - z)

(groups of 32, 64, 128, ... or one per row: each 32-block takes its group's s and z). The blocks
hold exactly the reference's values (the kernels' fused multiply-add rounds scale * code + offset
once), except 8-bit codes with z != 128 and float32 scales, where s * (128 - z) may round. The
activations stay float32 (the kernel quantizes them per 32-block itself when it takes integer
dots), so `takes_float_input` tells the W8A8 layer to skip its own per-token quantization.
Before this, both layers dequantized their whole weight on every call on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from baryon.kernels.block_quant import BLOCK, CpuBlockQuantLinear, _check_shape, dequantize_rows, pack_rows
from baryon.kernels.quant.w4a16 import _check_canonical
from baryon.kernels.selector import Kernel, select


@dataclass
class PackedBlockWeights:
    """A layer's weight in the block layout: packed uint8 [N, row_bytes(K, bits)]."""

    packed: torch.Tensor
    bits: int  # code width of the packed rows: 4 or 8
    in_features: int
    out_features: int
    kernel: type  # the block_quant_linear kernel that multiplies them


def _block_kernel(in_features: int, bits: int) -> type:
    return select("block_quant_linear", torch.device("cpu"), in_features=in_features, bits=bits, dtype=torch.float32)


def _pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int) -> PackedBlockWeights:
    """codes [N, K] (0..15 or int8), scale / offset [N, K/32] float32 -> PackedBlockWeights."""
    n, k = codes.shape
    packed = pack_rows(codes.numpy(), scale.float().numpy(), offset.float().numpy(), bits)
    return PackedBlockWeights(packed, bits, k, n, _block_kernel(k, bits))


def _reason(in_features: int | None, bits: int, dtype: torch.dtype | None) -> str | None:
    """The block kernels' own limits (a layer not yet sized or typed passes those checks)."""
    return _check_shape(in_features or BLOCK, bits, dtype or torch.float32)


class _CpuBlockKernel(Kernel):
    name = "cpu"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return CpuBlockQuantLinear.unsupported_reason(device)

    @staticmethod
    def dequantize(weights: PackedBlockWeights) -> torch.Tensor:
        """float32 [N, K]: the values the blocks hold."""
        return dequantize_rows(weights.packed, weights.in_features, weights.bits)

    @staticmethod
    def run(x: torch.Tensor, weights: PackedBlockWeights, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, weights.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        out = weights.kernel.forward(x2, weights.packed, weights.bits, weights.in_features,
                                     None if bias is None else bias.float())
        return out.view(*x.shape[:-1], weights.out_features).to(x.dtype)


class CpuBlockInt8Linear(_CpuBlockKernel):
    family = "int8_linear"
    takes_float_input = True

    @classmethod
    def cannot_implement_reason(cls, in_features: int | None = None, dtype: torch.dtype | None = None,
                                **_: Any) -> str | None:
        return _reason(in_features, 8, dtype)

    @staticmethod
    def prepare(w_q: torch.Tensor, w_scale: torch.Tensor) -> PackedBlockWeights:
        """w_q int8 [N, K], w_scale [N] or [N, 1] -> every block of row n scaled by w_scale[n]."""
        if w_q.dtype != torch.int8 or w_q.dim() != 2:
            raise ValueError(f"int8 weights are int8 [N, K], not {w_q.dtype} {tuple(w_q.shape)}")
        n, k = w_q.shape
        scale = w_scale.reshape(n, 1).float().expand(n, k // BLOCK)
        return _pack(w_q, scale, torch.zeros(n, k // BLOCK), 8)

    @staticmethod
    def forward_float(x: torch.Tensor, weights: PackedBlockWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x float [M, K] -> [M, N]."""
        return CpuBlockInt8Linear.run(x, weights, bias)


class CpuBlockW4A16Linear(_CpuBlockKernel):
    family = "w4a16_linear"

    @classmethod
    def cannot_implement_reason(cls, *, in_features: int = BLOCK, bits: int = 4, group_size: int = 128,
                                dtype: torch.dtype = torch.float32, **_: Any) -> str | None:
        if group_size % BLOCK:
            return f"group_size={group_size} is not a multiple of {BLOCK}"
        return _reason(in_features, bits, dtype)

    @staticmethod
    def prepare(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                group_size: int) -> PackedBlockWeights:
        """The canonical inputs (codes uint8 [N, K], scales [N, G], zeros uint8 [N, G]) -> blocks."""
        group = _check_canonical(codes, scales, zeros, bits, group_size)
        n, k = codes.shape
        per_group = group // BLOCK
        s = scales.float().repeat_interleave(per_group, dim=1)[:, : k // BLOCK]  # [N, K/32]
        z = zeros.float().repeat_interleave(per_group, dim=1)[:, : k // BLOCK]
        if bits == 4 and bool((zeros == 8).all()):  # symmetric: s * 8 is exact, so is the offset
            return _pack(codes, s, -8 * s, 4)
        if bits == 4:  # zero points of any value: the codes minus their zero, as 8-bit codes
            z_full = zeros.to(torch.int16).repeat_interleave(group, dim=1)[:, :k]
            return _pack((codes.to(torch.int16) - z_full).to(torch.int8), s, torch.zeros_like(s), 8)
        return _pack((codes.to(torch.int16) - 128).to(torch.int8), s, s * (128 - z), 8)

    @staticmethod
    def forward(x: torch.Tensor, weights: PackedBlockWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        return CpuBlockW4A16Linear.run(x, weights, bias)

