"""SiLU-and-mul (the gated MLP activation): torch reference and Triton kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baryon.kernels.selector import Kernel
from baryon.kernels.triton_utils import (TritonKernel, next_power_of_2, pdl_launch, tl, triton,
                                         wait_and_release)


class TorchSiluAndMul(Kernel):
    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = silu(gate) * up."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(x, out, stride_x, stride_o, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_and_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x + row * stride_x + D + cols, mask=mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # rounded like torch's F.silu
        tl.store(out + row * stride_o + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=mask)


class TritonSiluAndMul(TritonKernel):
    family = "silu_and_mul"

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]."""
        rows, d = x.shape[0], x.shape[-1] // 2
        out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
        if rows:
            block = min(1024, next_power_of_2(d))
            _silu_and_mul_kernel[(rows, -(-d // block))](x, out, x.stride(0), out.stride(0), D=d, BLOCK=block,
                                                         **pdl_launch(x.device))
        return out
