"""Activation quantization before a quantized GEMM (family `act_quant`): torch references here.

Three shapes of scale, all float32, symmetric (no zero point):

    per token  x [M, K] -> q [M, K], scale [M, 1]           (FP8 / INT8 dynamic, rowwise GEMMs)
    per group  x [M, K] -> q [M, K], scale [M, ceil(K / g)] (FP8 1 x 128 groups, block-scaled GEMMs)
    static     x [M, K], scale [] -> q [M, K]               (a checkpoint's per-tensor input_scale)

with x ~= q * scale. q is float8_e4m3fn (saturated to +-448) or int8 (round half to even,
saturated to +-127). A dynamic scale is amax / qmax, with amax floored at 1e-10 so an all-zero
row quantizes to zeros instead of NaN.
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.selector import Kernel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
MIN_AMAX = 1e-10


def quant_max(dtype: torch.dtype) -> float:
    if dtype == FP8:
        return FP8_MAX
    if dtype == torch.int8:
        return INT8_MAX
    raise ValueError(f"activations quantize to {FP8} or torch.int8, not {dtype}")


def _cast(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values already divided by their scale -> dtype, saturated."""
    qmax = quant_max(dtype)
    if dtype == torch.int8:
        scaled = torch.round(scaled)
    return scaled.clamp(-qmax, qmax).to(dtype)


def quantize_per_token_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] dtype, scale [M, 1] float32)."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / quant_max(dtype)
    return _cast(x32 / scale, dtype), scale


def quantize_per_group_reference(x: torch.Tensor, group_size: int,
                                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] dtype, scale [M, ceil(K / group_size)] float32); the last group
    may be short."""
    m, k = x.shape
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_size - k)).view(m, groups, group_size)
    scale = padded.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / quant_max(dtype)  # [M, G, 1]
    q = _cast(padded / scale, dtype).view(m, groups * group_size)[:, :k]
    return q.contiguous(), scale.squeeze(-1)


def quantize_static_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [M, K], scale [] or [1] float32 -> q [M, K] dtype."""
    return _cast(x.float() / scale.float().reshape(()), dtype)


class TorchActQuant(Kernel):
    name = "torch"

    @classmethod
    def cannot_implement_reason(cls, **_: Any) -> str | None:
        return None

    per_token = staticmethod(quantize_per_token_reference)
    per_group = staticmethod(quantize_per_group_reference)
    static = staticmethod(quantize_static_reference)
