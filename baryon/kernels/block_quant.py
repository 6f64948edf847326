"""Linear layers over block-quantized weights, kept quantized in memory (GGUF's Q4_0/Q4_1/Q4_K/Q5_*/Q6_K/Q8_0).

baryon's packed format stores each row of a weight [N, K] (K a multiple of 32) as one run of bytes,
so a row slice of the packed tensor is a row slice of the weight (fused q/k/v and gate/up load
row ranges into it like float weights):

    codes      bits 4: K/2 bytes; byte j of a 32-element block holds element j in its low nibble
               and element j + 16 in its high nibble
               bits 6 and 8: K bytes, int8 codes in element order
    pairs      K/32 pairs, one per block, float32 or (where every value is one, as GGUF's Q4_0,
               Q4_1, Q5_0, Q5_1 and Q8_0 store them) float16: bits 4 and 8, (scale, min); bits
               6, (scale of elements 0..15, scale of elements 16..31); a tensor's row length
               says which (`pair_bytes`)

and weight[n, k] = scale * code + min for k's block (bits 6: scale of k's half-block * code, no
offset). Every GGUF type with one scale and one offset per 32 elements maps onto bits 4 or 8
exactly (Q4_K's 6-bit sub-block scales are multiplied out into the float32 scale and min; Q4_0 is
min = -8 * scale); Q6_K, a scale per 16 elements and no offset, is bits 6: its codes q - 32
(-32..31) as int8 and d * sc (exact in float32: a float16 times an int8) for each half-block.

Kernels (family `block_quant_linear`, in the selector's order):
- `cpu_int8` (`kernels/cpu/block_quant_int8_dot.cpp`, the default where the CPU has AVX-512 VNNI
  or AVX2):
  llama.cpp's integer scheme. Each 32-block of x is quantized to int8 (scale max|x| / 127, the
  float sum kept), the codes are multiplied as integers (vpdpbusd) and the scales applied per
  block: y ~= sum over blocks of scale * d * sum(code * q) + min * sum(x) (bits 6: each
  16-element half's integer dot times its own scale, no min term). Not float32-exact: the
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

BLOCK = 32  # elements per pair
BITS = (4, 6, 8)
PAIR_BYTES = (8, 4)  # a float32 pair, a float16 pair


def code_bytes(in_features: int, bits: int) -> int:
    """Bytes of one packed row's codes: K/2 nibble pairs (bits 4) or K int8 codes (bits 6, 8)."""
    return in_features // 2 if bits == 4 else in_features


def row_bytes(in_features: int, bits: int, pair_bytes: int = 8) -> int:
    """Bytes of one packed row: the codes, then a pair per block (8 bytes: float32; 4: float16)."""
    return code_bytes(in_features, bits) + in_features // BLOCK * pair_bytes


def pair_bytes_of(packed: torch.Tensor, in_features: int, bits: int) -> int:
    """8 (float32 pairs) or 4 (float16 pairs), from the packed rows' length."""
    for width in PAIR_BYTES:
        if packed.shape[-1] == row_bytes(in_features, bits, width):
            return width
    raise ValueError(f"packed rows of {packed.shape[-1]} bytes fit neither pair width for in_features={in_features}, "
                     f"bits={bits} (expected {row_bytes(in_features, bits, 8)} or {row_bytes(in_features, bits, 4)})")


def pack_rows(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None, bits: int,
              pair_bytes: int = 8) -> torch.Tensor:
    """codes [N, K] (uint8 0..15 for bits 4, int8 for bits 6 and 8) and their scales -> packed uint8
    [N, row_bytes(K, bits, pair_bytes)]. Bits 4 and 8: scale / minimum [N, K/32] float32; bits 6:
    scale [N, K/16] float32 (one per 16 elements, in element order) and minimum None. pair_bytes 4
    stores the pairs as float16, which must hold every value exactly (a ValueError otherwise)."""
    n, k = codes.shape
    if bits == 4:
        blocks = codes.reshape(n, k // BLOCK, 2, BLOCK // 2).astype(np.uint8)
        code_data = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)
    else:
        code_data = codes.astype(np.int8).view(np.uint8)
    # [N, K/32, 2]: a block's two half-block scales are consecutive in element order already.
    pairs = scale.reshape(n, k // BLOCK, 2) if bits == 6 else np.stack([scale, minimum], axis=-1)
    pairs = pairs.astype(np.float32).reshape(n, -1)
    if pair_bytes == 4:
        halves = pairs.astype(np.float16)
        if not np.array_equal(halves.astype(np.float32), pairs):
            raise ValueError("these scales and offsets are not all float16 values: pack them with pair_bytes=8")
        pairs = halves
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([code_data, pairs.view(np.uint8)], axis=1)))


def _codes(packed: torch.Tensor, in_features: int, bits: int) -> torch.Tensor:
    """The raw codes of packed rows: [N, row_bytes] -> float32 [N, K/32, 32] (0..15 or int8)."""
    n, k = packed.shape[0], in_features
    data = packed[:, : code_bytes(k, bits)]
    if bits == 4:
        blocks = data.reshape(n, k // BLOCK, BLOCK // 2)
        return torch.cat([blocks & 15, blocks >> 4], dim=-1).float()
    return data.contiguous().view(torch.int8).reshape(n, k // BLOCK, BLOCK).float()


def _scales(packed: torch.Tensor, in_features: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of packed rows as float64 (half-block scales [N, K/32, 2], the scale of
    elements 0..15 and of 16..31 of each block; mins [N, K/32], zero for bits 6)."""
    n, k = packed.shape[0], in_features
    dtype = torch.float16 if pair_bytes_of(packed, k, bits) == 4 else torch.float32
    pairs = packed[:, code_bytes(k, bits):].contiguous().view(dtype).reshape(n, k // BLOCK, 2).double()
    if bits == 6:
        return pairs, torch.zeros_like(pairs[..., 0])
    return pairs[..., :1].expand(-1, -1, 2), pairs[..., 1]


def dequantize_rows(packed: torch.Tensor, in_features: int, bits: int) -> torch.Tensor:
    """packed uint8 [N, row_bytes] -> float32 [N, in_features] (the reference dequantization)."""
    n = packed.shape[0]
    codes = _codes(packed, in_features, bits).reshape(n, -1, 2, BLOCK // 2)  # [N, B, 2 halves, 16]
    half_scales, minimum = _scales(packed, in_features, bits)  # [N, B, 2], [N, B]
    # In float64, then rounded once: the C++ kernels' fused multiply-add (scale * code + min is
    # exact there too), so a block holding scale * (code - z) with a power-of-two z reads back exactly.
    weight = codes.double() * half_scales[..., None] + minimum[..., None, None]
    return weight.float().reshape(n, in_features)


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
    """The integer-dot numerics in torch: x [M, K] float32 -> [M, N]. The integer dot products of
    each 16-element half-block are exact in float64; each block adds
    (scale of half 0 * dot of half 0 + scale of half 1 * dot of half 1) * d + min * sum(x)."""
    n, k = packed.shape[0], in_features
    q, d, sums = quantize_activation_blocks(x)  # [M, B, 32], [M, B, 1], [M, B, 1]
    half_scales, minimum = _scales(packed, k, bits)  # [N, B, 2], [N, B]
    codes = _codes(packed, k, bits).reshape(n, k // BLOCK, 2, BLOCK // 2)  # [N, B, 2 halves, 16]
    q_halves = q.reshape(q.shape[0], k // BLOCK, 2, BLOCK // 2)  # [M, B, 2, 16]
    dots = torch.einsum("mbhi,nbhi->mnbh", q_halves.double(), codes.double())  # [M, N, B, 2], exact integers
    y = ((dots * half_scales).sum(dim=-1) * d[..., 0].double()[:, None, :]  # [M, N, B]
         + minimum * sums[..., 0].double()[:, None, :]).sum(dim=-1).float()
    return y if bias is None else y + bias


def _check_shape(in_features: int, bits: int, dtype: torch.dtype) -> str | None:
    if bits not in BITS:
        return f"bits={bits} (supported: {BITS}; 6 is Q6_K's layout)"
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
