"""Linear layers over block-quantized weights, kept quantized in memory (GGUF's Q4_0/Q4_1/Q4_K/Q5_*/Q8_0).

baryon's packed format stores each row of a weight [N, K] (K a multiple of 32) as one run of bytes,
so a row slice of the packed tensor is a row slice of the weight (fused q/k/v and gate/up load
row ranges into it like float weights):

    codes      bits 4: K/2 bytes; byte j of a 32-element block holds element j in its low nibble
               and element j + 16 in its high nibble
               bits 8: K bytes, int8 codes in element order
    scale_min  K/32 float32 pairs (scale, min), one per block

and weight[n, k] = scale * code + min for k's block. Every GGUF type with one scale and one offset
per 32 elements maps onto it exactly (Q4_K's 6-bit sub-block scales are multiplied out into the
float32 scale and min; Q4_0 is min = -8 * scale).

Kernels (family `block_quant_linear`, in the selector's order):
- `cpu_int8` (`kernels/cpu/block_quant_int8_dot.cpp`, the default where the CPU has AVX-512 VNNI
  or AVX2):
  llama.cpp's integer scheme. Each 32-block of x is quantized to int8 (scale max|x| / 127, the
  float sum kept), the codes are multiplied as integers (vpdpbusd) and the scales applied per
  block: y ~= sum over blocks of scale * d * sum(code * q) + min * sum(x). Not float32-exact: the
  activation rounding costs ~0.3% relative error per dot product; the torch reference of these
  numerics is `block_quant_linear_int8_reference`.
- `cpu_float32` (`kernels/cpu/block_quant_linear.cpp`): exact float32 arithmetic, dequantizing in
  registers (16 tokens per pass over the weights); what the transformers-parity tests run
  (`BARYON_KERNEL_BLOCK_QUANT_LINEAR=cpu_float32`).
- `torch`: the reference (dequantize the whole weight, then `F.linear`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from baryon.kernels.selector import Kernel

BLOCK = 32  # elements per (scale, min) pair
BITS = (4, 8)


def row_bytes(in_features: int, bits: int) -> int:
    """Bytes of one packed row: the codes, then a float32 (scale, min) per block."""
    return in_features * bits // 8 + in_features // BLOCK * 8


def pack_rows(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray, bits: int) -> torch.Tensor:
    """codes [N, K] (uint8 0..15 for bits 4, int8 for bits 8), scale / minimum [N, K/32] float32
    -> packed uint8 [N, row_bytes(K, bits)]."""
    n, k = codes.shape
    if bits == 4:
        blocks = codes.reshape(n, k // BLOCK, 2, BLOCK // 2).astype(np.uint8)
        code_bytes = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)
    else:
        code_bytes = codes.astype(np.int8).view(np.uint8)
    scale_min = np.stack([scale, minimum], axis=-1).astype(np.float32).reshape(n, -1).view(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([code_bytes, scale_min], axis=1)))


def dequantize_rows(packed: torch.Tensor, in_features: int, bits: int) -> torch.Tensor:
    """packed uint8 [N, row_bytes] -> float32 [N, in_features] (the reference dequantization)."""
    n, k = packed.shape[0], in_features
    code_bytes = packed[:, : k * bits // 8]
    scale_min = packed[:, k * bits // 8:].contiguous().view(torch.float32).reshape(n, k // BLOCK, 2)
    if bits == 4:
        blocks = code_bytes.reshape(n, k // BLOCK, BLOCK // 2)
        codes = torch.cat([blocks & 15, blocks >> 4], dim=-1).float()  # [n, blocks, 32]
    else:
        codes = code_bytes.contiguous().view(torch.int8).reshape(n, k // BLOCK, BLOCK).float()
    # In float64, then rounded once: the C++ kernels' fused multiply-add (scale * code + min is
    # exact there too), so a block holding scale * (code - z) with a power-of-two z reads back exactly.
    return (codes.double() * scale_min[..., :1].double() + scale_min[..., 1:].double()).float().reshape(n, k)


def block_quant_linear_reference(x: torch.Tensor, packed: torch.Tensor, bits: int, in_features: int,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 -> [M, N]: dequantize, then an ordinary linear."""
    return F.linear(x, dequantize_rows(packed, in_features, bits), bias)


def quantize_activation_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> q [M, K/32, 32] (integers in -127..127, as float32), scale d [M, K/32, 1]
    (max|x| / 127 per block) and the float sum of each block [M, K/32, 1]: x ~= d * q."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(blocks * inverse), d, blocks.sum(dim=-1, keepdim=True)


def block_quant_linear_int8_reference(x: torch.Tensor, packed: torch.Tensor, bits: int, in_features: int,
                                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The integer-dot numerics in torch: x [M, K] float32 -> [M, N]. The per-block integer dot
    products are exact in float64; each block adds scale * d * dot + min * sum(x)."""
    n, k = packed.shape[0], in_features
    q, d, sums = quantize_activation_blocks(x)  # [M, B, 32], [M, B, 1], [M, B, 1]
    scale_min = packed[:, k * bits // 8:].contiguous().view(torch.float32).reshape(n, k // BLOCK, 2)
    codes = (dequantize_rows(torch.cat([packed[:, : k * bits // 8], _unit_scales(n, k)], dim=1), k, bits)
             .reshape(n, k // BLOCK, BLOCK))  # the raw codes: scale 1, min 0
    dots = torch.einsum("mbi,nbi->mnb", q.double(), codes.double())  # [M, N, B], exact integers
    y = (dots * (scale_min[..., 0].double() * d[..., 0].double()[:, None, :])
         + scale_min[..., 1].double() * sums[..., 0].double()[:, None, :]).sum(dim=-1).float()
    return y if bias is None else y + bias


def _unit_scales(rows: int, in_features: int) -> torch.Tensor:
    """(scale 1, min 0) pairs for every block of `rows` packed rows, as the packed bytes."""
    pairs = torch.tensor([1.0, 0.0]).repeat(rows, in_features // BLOCK)
    return pairs.view(torch.uint8).reshape(rows, -1)


def _check_shape(in_features: int, bits: int, dtype: torch.dtype) -> str | None:
    if bits not in BITS:
        return f"bits={bits} (supported: {BITS})"
    if in_features % BLOCK:
        return f"in_features={in_features} is not a multiple of {BLOCK}"
    if dtype != torch.float32:
        return f"activations in {dtype} (the packed kernels compute in float32)"
    return None


class CpuBlockQuantLinear(Kernel):
    """The exact C++ kernel: weights stay packed; each block is dequantized in registers."""

    name = "cpu_float32"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return "runs on CPU only"
        from baryon.kernels.cpu import load_error

        return load_error()

    @classmethod
    def cannot_implement_reason(cls, *, in_features: int, bits: int, dtype: torch.dtype, **_: Any) -> str | None:
        return _check_shape(in_features, bits, dtype)

    @staticmethod
    def forward(x: torch.Tensor, packed: torch.Tensor, bits: int, in_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.baryon_cpu.block_quant_linear(x, packed, bits, in_features, bias)


class CpuInt8BlockQuantLinear(CpuBlockQuantLinear):
    """The C++ integer-dot kernel (AVX-512 VNNI or AVX2): weights stay packed, activations are
    quantized per 32-block to int8."""

    name = "cpu_int8"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        reason = super().unsupported_reason(device)
        if reason is None and not torch.ops.baryon_cpu.block_quant_int8_dot_isa():
            return "this CPU has neither AVX-512 VNNI nor AVX2 (the integer dot products would run one lane at a time)"
        return reason

    @staticmethod
    def forward(x: torch.Tensor, packed: torch.Tensor, bits: int, in_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.baryon_cpu.block_quant_linear_int8(x, packed, bits, in_features, bias)


class TorchBlockQuantLinear(Kernel):
    name = "torch"

    @classmethod
    def cannot_implement_reason(cls, *, in_features: int, bits: int, dtype: torch.dtype, **_: Any) -> str | None:
        return _check_shape(in_features, bits, dtype)

    forward = staticmethod(block_quant_linear_reference)
