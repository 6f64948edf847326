"""W8A8 INT8 linear layers on AMD Zen CPUs through zentorch (family `int8_linear`, the optional
extra `pip install -e ".[zen]"`): `zentorch_dynamic_qlinear` quantizes the activations per token,
symmetric (the scheme `Int8LinearMethod` uses), multiplies int8 x int8 with AVX-512 VNNI and
applies both scales. It takes the float activations (`takes_float_input`), so the layer skips its
own activation quantization. Same weight layout as the other int8 kernels (w_q [N, K], w_scale [N]).
"""

from __future__ import annotations

from typing import Any

import torch

from baryon.kernels.cpu.zentorch_support import zentorch_unavailable_reason
from baryon.kernels.quant.int8_gemm import Int8Weights, dequantize_int8_weights, prepare_int8_weights
from baryon.kernels.selector import Kernel


class ZentorchInt8Linear(Kernel):
    name = "zentorch"
    family = "int8_linear"
    takes_float_input = True
    OPS = ("zentorch_dynamic_qlinear",)

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        # On an AVX2-only CPU the op returns wrong values or dies of SIGILL (zentorch_support).
        return zentorch_unavailable_reason(device, cls.OPS, isa=("avx512f", "avx512bw", "avx512_vnni"))

    @classmethod
    def cannot_implement_reason(cls, dtype: torch.dtype | None = None, **_: Any) -> str | None:
        if dtype not in (None, torch.float32):
            return f"activations in {dtype} (zentorch's dynamic int8 linear is used for float32 here)"
        return None

    prepare = staticmethod(prepare_int8_weights)
    dequantize = staticmethod(dequantize_int8_weights)

    @staticmethod
    def forward_float(x: torch.Tensor, weights: Int8Weights, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x float32 [M, K] -> [M, N] float32: x quantized per row to int8 (symmetric), times w_q,
        times both scales, plus bias."""
        x2 = x if x.is_contiguous() else x.contiguous()
        return torch.ops.zentorch.zentorch_dynamic_qlinear(x2, weights.w_q, weights.w_scale, bias)
