"""Dense float linear layers on CPU: y = x @ weight.T + bias (family `dense_linear`).

`torch` is F.linear (oneDNN / MKL). `zentorch` is zentorch's linear (AOCL-BLAS), offered when the
extra is installed. Neither wins everywhere (measured on a 2-core Zen 3, float32: zentorch is
1.5-5x faster for 4-64 rows, about even at 1 and 128 rows), so a layer does not take the first
that accepts: `DenseLinearMethod` times both on the layer's shape at load (`select_fastest`).
GPU layers keep F.linear without asking.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from baryon.kernels.cpu.zentorch_support import zentorch_unavailable_reason
from baryon.kernels.selector import Kernel


class TorchDenseLinear(Kernel):
    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K], weight [N, K], bias [N] or None -> [..., N]."""
        return F.linear(x, weight, bias)


class ZentorchDenseLinear(Kernel):
    name = "zentorch"
    OPS = ("zentorch_linear_unary",)

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return zentorch_unavailable_reason(device, cls.OPS, isa=("avx2", "fma"))

    @classmethod
    def cannot_implement_reason(cls, dtype: torch.dtype = torch.float32, **_: Any) -> str | None:
        if dtype == torch.float32:
            return None
        if dtype == torch.bfloat16:  # without the instructions zentorch's bf16 GEMM returns NaN
            return zentorch_unavailable_reason(torch.device("cpu"), cls.OPS, isa=("avx512_bf16",))
        return f"{dtype} (zentorch's linear takes float32, or bfloat16 on CPUs with avx512_bf16)"

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = torch.ops.zentorch.zentorch_linear_unary(x2, weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
